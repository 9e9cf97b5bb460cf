//! The Q8_0 and 4-bit products on Intel AMX tiles (x86-64, Sapphire Rapids and later), for
//! the activation rows that fill whole 16-row tiles; the rest of a call (a last partial tile
//! of rows, or fewer than 16 rows: a batch-1 decode) runs the AVX-512 kernel that reads the
//! same weight order. The 4-bit weights are unpacked into tile order once per call
//! ([`q4_pair_tiles`]); the rest of this note is about Q8_0.
//!
//! `tdpbssd` multiplies a 16 × 32-byte tile of signed activation bytes by a tile holding
//! one 32-value block of 16 weight rows in the "VNNI" order (`[k / 4][row][k % 4]`: a
//! row of the tile is four consecutive values of each of the 16 weight rows), and adds the
//! 16 × 16 integer products: 8 192 multiply-adds in one instruction. Q8_0 has a scale per
//! block on both sides, so each block's integer tile is stored (1 KiB, L1) and added in f32
//! with the two scales' product by AVX-512 (`vcvtdq2ps`, `vfmadd`): sixteen output rows
//! per vector instead of one or two.
//!
//! - 8-bit activations: the signed bytes ([`crate::Activations`]' `s8`), `tdpbssd`.
//! - 16-bit activations: `a = 256 · hi + lo`, `hi` signed (`tdpbssd`), `lo` unsigned
//!   (`tdpbusd`): the two integer tiles are combined as `(Σ hi·w) << 8 + Σ lo·w`, exact
//!   (each below 2³¹ in magnitude), then converted as the scalar reference converts.
//!
//! The weights are packed in [`crate::Q8Layout::WideQuadColumns`] at load time, whose order
//! inside a 16-row tile's block (`[quad][row][4]`) is the tile order itself: `tileloadd`
//! reads them where they lie, with no repack per call (an earlier form put each group into
//! tile order on every call, which took a third to a half of a 16- to 32-row product's time;
//! `docs/design/kernels.md` has the measurement), and the AVX-512 kernel's `vpdpbusd` reads
//! the same bytes for the rows AMX leaves over. The f16 scales sit beside them
//! (`[tile][block][row]`), 16 to a 32-byte load.
//!
//! The tile instructions are written with `asm!` (Rust's AMX intrinsics are not stable);
//! each call saves the thread's tile configuration (`sttilecfg`), loads its own and puts the
//! saved one back before it returns, so another user of the tiles on the same thread
//! (candle's 4-bit AMX kernel, which configures a thread once and keeps it) is unaffected.
//! Linux hands a thread AMX state only after the process asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`granted`] asks once, and a refusal (a virtual
//! machine whose kernel does not pass AMX through) leaves [`crate::Isa::Amx`] unavailable.

use crate::layout::{ActBits, Activations, PackedQ8, BLOCK, ROW_BLOCK};
use crate::q4::PackedQ4;
use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::OnceLock;

/// Output rows in one AMX group: one tile of [`crate::Q8Layout::WideQuadColumns`].
const GROUP_ROWS: usize = crate::layout::WIDE_PAIR_TILE_ROWS;
/// Activation rows in one AMX tile.
const M_TILE: usize = 16;
/// Bytes of one weight block of a group in tile order.
const GROUP_BLOCK_BYTES: usize = GROUP_ROWS * BLOCK;

/// Whether this CPU has AMX-INT8 tiles and the kernel lets this process use them (asked
/// once per process).
pub(crate) fn granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| cpu_has_amx_int8() && request_tile_data())
}

fn cpu_has_amx_int8() -> bool {
    // CPUID leaf 7, sub-leaf 0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
    let leaf7 = __cpuid_count(7, 0);
    let tile = leaf7.edx & (1 << 24) != 0;
    let int8 = leaf7.edx & (1 << 25) != 0;
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS manages the tile state.
    // SAFETY: `xgetbv` is available where the OS enabled XSAVE (OSXSAVE, CPUID 1 ECX bit 27).
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    let xcr0 = if osxsave { unsafe { xgetbv0() } } else { 0 };
    tile && int8 && xcr0 & (0b11 << 17) == 0b11 << 17
}

#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    _xgetbv(0)
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    unsafe extern "C" {
        fn syscall(number: i64, ...) -> i64;
    }
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only changes which state the
    // kernel lets this process's threads use; it reads and writes no memory of ours.
    unsafe { syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The tile configuration (`ldtilecfg`'s 64 bytes): palette 1; tiles 0–1 the integer
/// results (16 × 16 i32), 2–3 the activations (16 × 32 bytes), 4–5 the weights
/// (8 × 64 bytes). Two of each, so that two products are in flight: 8-bit activations
/// take two blocks at a time, 16-bit ones a block's high and low bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        let mut c = TileConfig([0; 64]);
        c.0[0] = 1;
        for (t, rows, colsb) in [
            (0, 16, 64u16),
            (1, 16, 64),
            (2, 16, 32),
            (3, 16, 32),
            (4, 8, 64),
            (5, 8, 64),
        ] {
            c.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c.0[48 + t] = rows;
        }
        c
    }
}

/// As [`crate::scalar::q8_tiles`], for weights in [`crate::Q8Layout::WideQuadColumns`]
/// (tiles of 16 rows: one AMX group each, already in the tile order), the tiles `tiles`: the
/// activation rows that fill whole 16-row tiles on AMX, the rest (and every row when there
/// is no whole tile of them) on the AVX-512 quad kernel. The activations hold their AMX
/// byte form; `bytes` is that form as the AVX-512 kernel takes it.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q8_quad_tiles(
    w: &PackedQ8,
    a: &Activations,
    bytes: (&[u8], &[u8], bool),
    tiles: Range<usize>,
    out: *mut f32,
) {
    let m16 = a.rows / M_TILE * M_TILE;
    if m16 < a.rows {
        crate::avx512::q8_quad_tiles(w, a, bytes, tiles.clone(), m16..a.rows, out);
    }
    if m16 == 0 {
        return;
    }
    let sixteen = a.bytes == Some(ActBits::Sixteen);
    with_tiles(|| {
        // A block of activation rows stays in L2 while the thread's tiles go by, each
        // tile's weights in L1 while the block's 16-row tiles go by.
        let mut m0 = 0;
        while m0 < m16 {
            let m1 = (m0 + ROW_BLOCK).min(m16);
            for t in tiles.clone() {
                let mut m = m0;
                while m < m1 {
                    match sixteen {
                        true => tile_rows::<true>(w, a, t, m, out),
                        false => tile_rows::<false>(w, a, t, m, out),
                    }
                    m += M_TILE;
                }
            }
            m0 = m1;
        }
    });
}

/// Run `f` with this module's tile configuration loaded, and the thread's own (saved first)
/// put back after it.
#[inline]
unsafe fn with_tiles(f: impl FnOnce()) {
    let mut saved = TileConfig([0; 64]);
    asm!("sttilecfg [{}]", in(reg) saved.0.as_mut_ptr(), options(nostack));
    let cfg = TileConfig::new();
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    f();
    asm!("ldtilecfg [{}]", in(reg) saved.0.as_ptr(), options(nostack, readonly));
}

/// One block's integer tile: 16 activation rows × 16 weight rows, as `tilestored` writes it.
#[repr(C, align(64))]
struct Ints([[i32; 16]; 16]);

impl Ints {
    /// Row `i`, or with `lo` (a 16-bit block's low bytes' tile, this one its high bytes')
    /// the exact sum `(hi << 8) + lo`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn row(&self, lo: Option<&Ints>, i: usize) -> __m512i {
        let v = _mm512_load_si512(self.0[i].as_ptr() as *const _);
        match lo {
            Some(l) => _mm512_add_epi32(
                _mm512_slli_epi32::<8>(v),
                _mm512_load_si512(l.0[i].as_ptr() as *const _),
            ),
            None => v,
        }
    }
}

/// The tile products of one weight form: 8-bit Q8_0 weights are signed bytes, 4-bit levels
/// unsigned ones, so each takes its own instructions (signed activations by the weights; the
/// 16-bit activations' unsigned low bytes by the weights).
trait TileProducts {
    /// Blocks `b` and `b + 1` of activation rows `m ..` (8-bit) into `c0` and `c1`.
    unsafe fn two(
        a0: *const u8,
        a1: *const u8,
        s: usize,
        w0: *const u8,
        w1: *const u8,
        c0: *mut Ints,
        c1: *mut Ints,
    );
    /// One block's high bytes into `c0` and low bytes into `c1` (16-bit).
    unsafe fn split(
        h: *const u8,
        l: *const u8,
        s: usize,
        w: *const u8,
        c0: *mut Ints,
        c1: *mut Ints,
    );
    /// One block (8-bit) into `c`.
    unsafe fn one(a: *const u8, s: usize, w: *const u8, c: *mut Ints);
}

/// Q8_0 weights (signed bytes): `tdpbssd`, and `tdpbusd` for the low bytes.
struct SignedWeights;
/// 4-bit levels 0..=15 (unsigned bytes): `tdpbsud`, and `tdpbuud` for the low bytes.
struct Levels;

macro_rules! tile_products {
    ($form:ty, $signed:literal, $unsigned:literal) => {
        impl TileProducts for $form {
            #[inline(always)]
            unsafe fn two(
                a0: *const u8,
                a1: *const u8,
                s: usize,
                w0: *const u8,
                w1: *const u8,
                c0: *mut Ints,
                c1: *mut Ints,
            ) {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tileloadd tmm4, [{w0} + {ws} * 1]",
                    "tileloadd tmm2, [{a0} + {s} * 1]",
                    "tileloadd tmm5, [{w1} + {ws} * 1]",
                    "tileloadd tmm3, [{a1} + {s} * 1]",
                    concat!($signed, " tmm0, tmm2, tmm4"),
                    concat!($signed, " tmm1, tmm3, tmm5"),
                    "tilestored [{c0} + {cs} * 1], tmm0",
                    "tilestored [{c1} + {cs} * 1], tmm1",
                    a0 = in(reg) a0,
                    a1 = in(reg) a1,
                    s = in(reg) s,
                    w0 = in(reg) w0,
                    w1 = in(reg) w1,
                    ws = in(reg) 64usize,
                    c0 = in(reg) c0,
                    c1 = in(reg) c1,
                    cs = in(reg) 64usize,
                    options(nostack),
                );
            }
            #[inline(always)]
            unsafe fn split(
                h: *const u8,
                l: *const u8,
                s: usize,
                w: *const u8,
                c0: *mut Ints,
                c1: *mut Ints,
            ) {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tileloadd tmm4, [{w} + {ws} * 1]",
                    "tileloadd tmm2, [{h} + {s} * 1]",
                    "tileloadd tmm3, [{l} + {s} * 1]",
                    concat!($signed, " tmm0, tmm2, tmm4"),
                    concat!($unsigned, " tmm1, tmm3, tmm4"),
                    "tilestored [{c0} + {cs} * 1], tmm0",
                    "tilestored [{c1} + {cs} * 1], tmm1",
                    h = in(reg) h,
                    l = in(reg) l,
                    s = in(reg) s,
                    w = in(reg) w,
                    ws = in(reg) 64usize,
                    c0 = in(reg) c0,
                    c1 = in(reg) c1,
                    cs = in(reg) 64usize,
                    options(nostack),
                );
            }
            #[inline(always)]
            unsafe fn one(a: *const u8, s: usize, w: *const u8, c: *mut Ints) {
                asm!(
                    "tilezero tmm0",
                    "tileloadd tmm4, [{w} + {ws} * 1]",
                    "tileloadd tmm2, [{a} + {s} * 1]",
                    concat!($signed, " tmm0, tmm2, tmm4"),
                    "tilestored [{c} + {cs} * 1], tmm0",
                    a = in(reg) a,
                    s = in(reg) s,
                    w = in(reg) w,
                    ws = in(reg) 64usize,
                    c = in(reg) c,
                    cs = in(reg) 64usize,
                    options(nostack),
                );
            }
        }
    };
}

tile_products!(SignedWeights, "tdpbssd", "tdpbusd");
tile_products!(Levels, "tdpbsud", "tdpbuud");

/// Every block of activation rows `m .. m + 16` against weight tiles `wts(b)`, two products in
/// flight (two blocks of 8-bit activations, or a block's high and low bytes), each block's
/// integer tiles handed to `add` (the low bytes' tile as its second argument).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn block_products<const SIXTEEN: bool, P: TileProducts>(
    blocks: usize,
    a: &Activations,
    m: usize,
    wts: impl Fn(usize) -> *const u8,
    add: &mut impl FnMut(&Ints, Option<&Ints>, usize),
    hi: &mut Ints,
    lo: &mut Ints,
) {
    let s = a.cols;
    let act = |bytes: *const u8, b: usize| bytes.add(m * a.cols + b * BLOCK);
    let s8 = a.s8.as_ptr() as *const u8;
    let mut b = 0;
    while b < blocks {
        if SIXTEEN {
            P::split(act(s8, b), act(a.lo.as_ptr(), b), s, wts(b), hi, lo);
            add(hi, Some(&*lo), b);
            b += 1;
        } else if b + 1 < blocks {
            P::two(act(s8, b), act(s8, b + 1), s, wts(b), wts(b + 1), hi, lo);
            add(hi, None, b);
            add(lo, None, b + 1);
            b += 2;
        } else {
            P::one(act(s8, b), s, wts(b), hi);
            add(hi, None, b);
            b += 1;
        }
    }
}

/// Activation rows `m .. m + 16` by the 16 weight rows of tile `t` (output columns
/// `16 t ..`, those past the weights' last row not written): 16 × 16 outputs. Block `b` of
/// the tile is the 8 × 64-byte weight tile itself (a row of it is four consecutive values of
/// each of the 16 weight rows), its 16 f16 scales one 32-byte load.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tile_rows<const SIXTEEN: bool>(
    w: &PackedQ8,
    a: &Activations,
    t: usize,
    m: usize,
    out: *mut f32,
) {
    let (mut hi, mut lo) = (Ints([[0; 16]; 16]), Ints([[0; 16]; 16]));
    let mut acc = [_mm512_setzero_ps(); M_TILE];
    let first = t * w.blocks;
    let wts = |b: usize| w.qs.as_ptr().add((first + b) * GROUP_BLOCK_BYTES) as *const u8;
    // Block `b`'s integer tile `c` (rows `m ..`, columns the tile's 16 weight rows) in f32.
    let mut add = |c: &Ints, l: Option<&Ints>, b: usize| {
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(
            w.d.as_ptr().add((first + b) * GROUP_ROWS) as *const __m256i,
        ));
        for (i, acc) in acc.iter_mut().enumerate() {
            let v = c.row(l, i);
            let da = _mm512_set1_ps(*a.d.get_unchecked((m + i) * a.blocks + b));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dw, da), *acc);
        }
    };
    block_products::<SIXTEEN, SignedWeights>(w.blocks, a, m, wts, &mut add, &mut hi, &mut lo);
    crate::avx512::store_tile(&acc, out, w.rows, t * GROUP_ROWS, m);
}

/// As [`crate::scalar::q4_tiles`], for [`PackedQ4`]'s tiles `tiles` (as the 4-bit product
/// hands them out: from an even tile, two at a time): the activation rows that fill whole
/// 16-row tiles on AMX for each whole pair of 8-row tiles, the rest (the rows past the last
/// whole 16, a last lone tile) on the AVX-512 4-bit kernel. The activations hold their AMX
/// byte form.
///
/// A pair's weights are unpacked once per call into the tile order (a block of it: 8 rows
/// of 64 bytes, four consecutive levels 0..=15 of each of the 16 weight rows) beside each
/// block's 16 steps and offsets in f32, and every 16-row tile of activations reuses them:
/// `tdpbsud` (signed activations by unsigned levels) gives `Σ q·a` per block, added in f32
/// as the AVX-512 kernel adds it (`d_w·d_a·Σ q·a + m_w·Σ a`, the same operations in the same
/// order, so the same bits). 16-bit activations take `tdpbsud` on the high bytes and
/// `tdpbuud` on the low ones, combined exactly as in the 8-bit weights' kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_pair_tiles(
    w: &PackedQ4,
    a: &Activations,
    tiles: Range<usize>,
    out: *mut f32,
) {
    let m16 = a.rows / M_TILE * M_TILE;
    let pairs_end = tiles.start + (tiles.end - tiles.start) / 2 * 2;
    if m16 < a.rows && tiles.start < pairs_end {
        crate::avx512::q4_tiles(w, a, tiles.start..pairs_end, m16..a.rows, out);
    }
    if pairs_end < tiles.end {
        crate::avx512::q4_tiles(w, a, pairs_end..tiles.end, 0..a.rows, out);
    }
    if m16 == 0 || tiles.start == pairs_end {
        return;
    }
    let sixteen = a.bytes == Some(ActBits::Sixteen);
    let sums = a.block_sums();
    // Pairs are unpacked a group at a time (the group in L2), then a block of activation
    // rows stays in L1 while the group's pairs go by, as in the 8-bit weights' kernel.
    let pair_bytes = w.blocks * Q4_UNPACKED_BLOCK;
    let group = (Q4_UNPACKED_GROUP_BYTES / pair_bytes).max(1);
    with_tiles(|| {
        Q4_UNPACKED.with_borrow_mut(|buf| {
            buf.resize(group * pair_bytes, 0);
            let mut g0 = tiles.start;
            while g0 < pairs_end {
                let g1 = (g0 + 2 * group).min(pairs_end);
                for (i, t) in (g0..g1).step_by(2).enumerate() {
                    unpack_q4_pair(w, t, &mut buf[i * pair_bytes..(i + 1) * pair_bytes]);
                }
                let mut m0 = 0;
                while m0 < m16 {
                    let m1 = (m0 + ROW_BLOCK).min(m16);
                    for (i, t) in (g0..g1).step_by(2).enumerate() {
                        let pair = &buf[i * pair_bytes..(i + 1) * pair_bytes];
                        let mut m = m0;
                        while m < m1 {
                            match sixteen {
                                true => q4_tile_rows::<true>(w, a, sums, pair, t, m, out),
                                false => q4_tile_rows::<false>(w, a, sums, pair, t, m, out),
                            }
                            m += M_TILE;
                        }
                    }
                    m0 = m1;
                }
                g0 = g1;
            }
        })
    });
}

/// Bytes of one unpacked block of a pair of 4-bit tiles: the 8 × 64-byte weight tile, then
/// the 16 rows' steps and offsets (f32).
const Q4_UNPACKED_BLOCK: usize = 8 * 64 + 2 * 64;
/// Bytes of unpacked pairs a thread keeps at once (at least one pair).
const Q4_UNPACKED_GROUP_BYTES: usize = 192 * 1024;

thread_local! {
    /// [`q4_pair_tiles`]' unpacked pair, one per thread, grown to the widest weights seen.
    static Q4_UNPACKED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Tiles `t` and `t + 1` of `w` into `buf`: per block the weight tile (row `k` of it, for
/// weight row `n`, holds columns `4k .. 4k + 4`), its 16 steps and its 16 offsets, both as
/// the AVX-512 kernel computes them.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn unpack_q4_pair(w: &PackedQ4, t: usize, buf: &mut [u8]) {
    use crate::q4::Q4_TILE_ROWS as G;
    let mut pair = crate::avx512::Q4Pair::new(w, t, t + 1);
    let nibble = _mm_set1_epi8(0x0f);
    for b in 0..w.blocks {
        let dst = buf.as_mut_ptr().add(b * Q4_UNPACKED_BLOCK);
        let (wb0, wb1) = pair.block(b);
        for k in 0..BLOCK / 4 {
            // Byte `2i + c` of a quad holds row `i`'s column `4k + c` (low nibble) and
            // `4k + 2 + c` (high): interleaving the two as 16-bit pairs gives each row's
            // four columns in order.
            for (h, wb) in [wb0, wb1].into_iter().enumerate() {
                let x = _mm_loadu_si128(wb.add(k * 2 * G) as *const __m128i);
                let lo = _mm_and_si128(x, nibble);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), nibble);
                let row = dst.add(k * 64 + h * 32) as *mut __m128i;
                _mm_storeu_si128(row, _mm_unpacklo_epi16(lo, hi));
                _mm_storeu_si128(row.add(1), _mm_unpackhi_epi16(lo, hi));
            }
        }
        let (dw, mw) = pair.scales(b);
        let scales = dst.add(8 * 64) as *mut f32;
        _mm512_storeu_ps(scales, dw);
        _mm512_storeu_ps(scales.add(16), mw);
    }
}

/// Activation rows `m .. m + 16` by the unpacked pair of 4-bit tiles `t`, `t + 1` in `buf`
/// (output columns `8 t ..`, those past the weights' last row not written).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q4_tile_rows<const SIXTEEN: bool>(
    w: &PackedQ4,
    a: &Activations,
    sums: &[f32],
    buf: &[u8],
    t: usize,
    m: usize,
    out: *mut f32,
) {
    let (mut hi, mut lo) = (Ints([[0; 16]; 16]), Ints([[0; 16]; 16]));
    let mut acc = [_mm512_setzero_ps(); M_TILE];
    let wts = |b: usize| buf.as_ptr().add(b * Q4_UNPACKED_BLOCK);
    // Block `b`'s integer tile `c` in f32, as the AVX-512 kernel adds a block.
    let mut add = |c: &Ints, l: Option<&Ints>, b: usize| {
        let scales = wts(b).add(8 * 64) as *const f32;
        let (dw, mw) = (_mm512_loadu_ps(scales), _mm512_loadu_ps(scales.add(16)));
        for (i, acc) in acc.iter_mut().enumerate() {
            let v = c.row(l, i);
            let row = (m + i) * a.blocks + b;
            let s = _mm512_mul_ps(dw, _mm512_set1_ps(*a.d.get_unchecked(row)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, *acc);
            *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sums.get_unchecked(row)), *acc);
        }
    };
    block_products::<SIXTEEN, Levels>(w.blocks, a, m, wts, &mut add, &mut hi, &mut lo);
    crate::avx512::store_tile(&acc, out, w.rows, t * crate::q4::Q4_TILE_ROWS, m);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{Activations, Isa, Pool, Q8Layout};

    fn stored() -> [u8; 64] {
        let mut c = TileConfig([0; 64]);
        // SAFETY: stores the 64-byte tile configuration into `c`; AMX is available.
        unsafe { asm!("sttilecfg [{}]", in(reg) c.0.as_mut_ptr(), options(nostack)) };
        c.0
    }

    fn load(c: &TileConfig) {
        // SAFETY: a valid palette-1 configuration (or palette 0: the initial state).
        unsafe { asm!("ldtilecfg [{}]", in(reg) c.0.as_ptr(), options(nostack, readonly)) };
    }

    /// A product on a thread whose tiles another kernel configured leaves that
    /// configuration as it found it, and a thread with none configured still has none.
    #[test]
    fn a_threads_tile_configuration_is_put_back() {
        if !Isa::Amx.available() {
            eprintln!("skipped: this CPU (or its operating system) offers no AMX");
            return;
        }
        let (rows, cols, m) = (32, 64, 16);
        let w = PackedQ8::quantize_in(
            &vec![0.25; rows * cols],
            rows,
            cols,
            Q8Layout::WideQuadColumns,
        )
        .unwrap();
        let mut a = Activations::new();
        a.quantize_with(&vec![0.5; m * cols], m, cols, ActBits::Eight, Isa::Amx)
            .unwrap();
        let one = Pool::new(1); // the caller's thread runs the product
        let mut out = vec![0f32; m * rows];

        let mut other = TileConfig([0; 64]);
        other.0[0] = 1;
        other.0[16..18].copy_from_slice(&64u16.to_le_bytes());
        other.0[48] = 16;
        load(&other);
        w.matmul(&a, &mut out, Isa::Amx, &one).unwrap();
        assert_eq!(stored(), other.0);
        assert!(out
            .iter()
            .all(|&v| (v - 0.25 * 0.5 * cols as f32).abs() < 1e-3));

        load(&TileConfig([0; 64]));
        w.matmul(&a, &mut out, Isa::Amx, &one).unwrap();
        assert_eq!(stored(), [0u8; 64]);
    }
}
