//! Which instruction set the kernels use, decided once per process.

use std::cell::Cell;
use std::sync::OnceLock;

thread_local! {
    static OVERRIDE: Cell<Option<Isa>> = const { Cell::new(None) };
}

/// An instruction set a kernel is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust: the reference every SIMD kernel must equal.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (every x86 server since 2013, AVX-512 machines included).
    Avx2,
    /// x86-64 AVX-VNNI (the VEX-encoded `vpdpwssd` on 256 bits) on top of [`Isa::Avx2`]:
    /// Intel since Alder Lake (clients) and Sierra Forest (E-core Xeons, which have no
    /// AVX-512), AMD since Zen 5. The Q8_0 and 4-bit products fuse each pair
    /// multiply-add into one instruction (`vpmaddwd` + `vpaddd` under AVX2); the other
    /// kernels run their AVX2 form. Below [`Isa::Avx512`] in preference: a CPU with both
    /// runs the 512-bit kernels.
    AvxVnni,
    /// x86-64 AVX-512 F/BW with VNNI (`vpdpwssd`), on top of [`Isa::Avx2`]: Intel since
    /// Cascade Lake, AMD since Zen 4. The Q8_0 product uses it; the other kernels run their
    /// AVX2 form.
    Avx512,
    /// Intel AMX-INT8 tiles on top of [`Isa::Avx512`] (Sapphire Rapids and later, where the
    /// operating system grants the tile state): the Q8_0 product of every whole 16 × 16 tile
    /// of (activation rows × output rows) — prefill chunks and batched decode steps; the
    /// rows left over, and every other kernel, run as under [`Isa::Avx512`].
    Amx,
    /// aarch64 Advanced SIMD (NEON), part of every ARMv8-A core: the Q8_0 and 4-bit
    /// products; the other kernels run their portable form.
    Neon,
}

impl Isa {
    pub fn as_str(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
            Isa::Neon => "neon",
        }
    }

    /// Whether this CPU can run `self` (detected once per process: kernels ask on every
    /// call, the KV cache's row reads once per 64 values).
    #[inline]
    pub fn available(self) -> bool {
        static AVAILABLE: OnceLock<[bool; Isa::ALL.len()]> = OnceLock::new();
        AVAILABLE.get_or_init(|| Isa::ALL.map(Isa::detect_available))[self as usize]
    }

    /// [`Isa::available`], asked of the CPU (and the OS, for AMX's tile state).
    fn detect_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_available(),
            Isa::AvxVnni => avx2_available() && avx_vnni_available(),
            Isa::Avx512 => avx2_available() && avx512_vnni_available(),
            Isa::Amx => Isa::Avx512.detect_available() && amx_granted(),
            Isa::Neon => neon_available(),
        }
    }

    /// Every instruction set, in order of preference within an architecture (the best last).
    pub const ALL: [Isa; 6] = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::AvxVnni,
        Isa::Avx512,
        Isa::Amx,
        Isa::Neon,
    ];

    /// Every instruction set this CPU can run, the best last.
    pub fn all_available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.available()).collect()
    }

    /// What a kernel call made on this thread uses: the [`Isa::scoped`] choice inside one,
    /// else [`Isa::detect`]'s.
    pub fn current() -> Isa {
        OVERRIDE.with(Cell::get).unwrap_or_else(Isa::detect)
    }

    /// Run `f` with this thread's kernel calls on `self` (or the scalar reference when this
    /// CPU cannot run `self`): how a test runs one model on every instruction set in one
    /// process. The pool's workers follow the caller's choice.
    pub fn scoped<T>(self, f: impl FnOnce() -> T) -> T {
        let isa = if self.available() { self } else { Isa::Scalar };
        let before = OVERRIDE.with(|o| o.replace(Some(isa)));
        struct Restore(Option<Isa>);
        impl Drop for Restore {
            fn drop(&mut self) {
                OVERRIDE.with(|o| o.set(self.0));
            }
        }
        let _restore = Restore(before);
        f()
    }

    /// Whether the x86 SIMD kernels (AVX2 and up) run under `self`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn x86_simd(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Amx)
    }

    /// Whether the x86 AVX-512 kernels run under `self` (AMX CPUs run them for everything
    /// the tiles do not do).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn x86_avx512(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Amx)
    }

    /// Whether the Q8_0 product takes its activations as bytes as well (the AMX tiles, and
    /// `vpdpbusd` for the rows they leave over).
    pub(crate) fn byte_activations(self) -> bool {
        matches!(self, Isa::Amx)
    }

    /// The best this CPU runs, unless `QUANTMESH_KERNEL` names another (`scalar`, `avx2`,
    /// `avxvnni`, `avx512`, `amx`, `neon`;
    /// `auto` or unset: detect). A name the CPU cannot run, or an unknown one, falls back
    /// to detection with a message on stderr (once). Decided once per process.
    pub fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = *Isa::all_available().last().unwrap_or(&Isa::Scalar);
            match std::env::var("QUANTMESH_KERNEL").ok().as_deref() {
                None | Some("") | Some("auto") => best,
                Some(name) => match name.parse::<Isa>() {
                    Ok(isa) if isa.available() => isa,
                    Ok(isa) => {
                        eprintln!(
                            "QUANTMESH_KERNEL={name}: this CPU cannot run {}, using {}",
                            isa.as_str(),
                            best.as_str()
                        );
                        best
                    }
                    Err(e) => {
                        eprintln!("QUANTMESH_KERNEL: {e}; using {}", best.as_str());
                        best
                    }
                },
            }
        })
    }
}

impl std::str::FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "scalar" => Ok(Isa::Scalar),
            "avx2" => Ok(Isa::Avx2),
            "avxvnni" => Ok(Isa::AvxVnni),
            "avx512" => Ok(Isa::Avx512),
            "amx" => Ok(Isa::Amx),
            "neon" => Ok(Isa::Neon),
            other => Err(format!(
                "{other:?} is not scalar, avx2, avxvnni, avx512, amx, neon or auto"
            )),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx_vnni_available() -> bool {
    is_x86_feature_detected!("avxvnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx_vnni_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_vnni_available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_vnni_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn amx_granted() -> bool {
    crate::amx::granted()
}

#[cfg(not(target_arch = "x86_64"))]
fn amx_granted() -> bool {
    false
}

#[cfg(target_arch = "aarch64")]
fn neon_available() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

#[cfg(not(target_arch = "aarch64"))]
fn neon_available() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `available` indexes its table by the enum's order: `ALL` must list it in that order.
    #[test]
    fn the_availability_table_follows_the_enum() {
        for (i, isa) in Isa::ALL.into_iter().enumerate() {
            assert_eq!(isa as usize, i);
            assert_eq!(isa.available(), isa.detect_available());
        }
    }

    #[test]
    fn every_name_parses_back_and_sets_are_ordered_by_preference() {
        for isa in Isa::ALL {
            assert_eq!(isa.as_str().parse::<Isa>().unwrap(), isa);
        }
        assert!("avx3".parse::<Isa>().unwrap_err().contains("avxvnni"));
        // A set is offered only with the sets it builds on.
        let offered = Isa::all_available();
        assert_eq!(offered[0], Isa::Scalar);
        if offered.contains(&Isa::AvxVnni) || offered.contains(&Isa::Avx512) {
            assert!(offered.contains(&Isa::Avx2), "{offered:?}");
        }
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            offered.contains(&Isa::AvxVnni),
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni"),
            "{offered:?}"
        );
        // AVX-VNNI is preferred only where AVX-512 VNNI is absent.
        if Isa::Avx512.available() {
            assert_ne!(
                *offered.iter().rfind(|i| i.x86_simd()).unwrap(),
                Isa::AvxVnni
            );
        }
    }
}
