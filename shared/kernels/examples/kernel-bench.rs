//! Times the kernels alone on a model's shapes and prints GB/s (weights read) and
//! GMAC/s per instruction set and row count, each time also as a ratio to the AVX2 kernel's in
//! the same run, with a STREAM-like read of the same bytes
//! as the bandwidth bound.
//!
//! ```text
//! cargo run --release -p quantmesh-kernels --example kernel-bench -- [--shape 576x576,...] [--rows 1,8,32,128]
//! cargo run --release -p quantmesh-kernels --example kernel-bench -- --bandwidth-only
//! ```
//!
//! `--bandwidth-only` prints the read bandwidth alone (one line, `read bandwidth X GB/s`):
//! the bound a batch-1 decode that reads every weight once per token cannot pass.
//!
//! `--decode-stream 30` times one decode step's products alone: every shape but the last
//! once per layer (the last once, as a model's vocabulary table), each matrix its own
//! allocation, back to back as a decode step runs them, against one product over a single
//! matrix of the same bytes and the read bandwidth, per instruction set, for Q8_0 and 4-bit
//! weights, 16- and 8-bit activations (Q8_0 weights packed in the order the engine packs
//! for that width), at one activation row or at each of `--rows` (32: a step of 32 decoding
//! streams). The gap between the two products is what the boundaries between a token's
//! products cost; at one row, GB/s against the bandwidth says how near the weights' bytes
//! set the time.
//!
//! `--attention 256,1024` times instead one decode row's attention (SmolLM2's 9 heads over
//! 3 key/value heads of 64) over that many cached positions, keys and values in f32 or as
//! 8-bit integers with a scale per row (the INT8 KV cache's form), per instruction set, on
//! the pool's threads and on one (as each sequence of a batched decode step runs).

use quantmesh_kernels::{
    attention_over, f16_matmul, ActBits, Activations, AttentionShape, Contiguous, Isa, PackedQ4,
    PackedQ8, Pool, Q8Layout,
};
use std::time::Instant;

/// Seconds per call of `run`: the median of five timed runs of at least 40 ms each (after
/// one untimed call), so one preempted stretch on a shared VM moves the figure little.
fn seconds_per_call(mut run: impl FnMut()) -> f64 {
    run();
    let mut per_call: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            let mut calls = 0u32;
            while calls == 0 || t.elapsed().as_secs_f64() < 0.04 {
                run();
                calls += 1;
            }
            t.elapsed().as_secs_f64() / f64::from(calls)
        })
        .collect();
    per_call.sort_by(f64::total_cmp);
    per_call[2]
}

fn main() {
    let mut shapes = vec![
        (960, 576),
        (576, 576),
        (3072, 576),
        (576, 1536),
        (49152, 576),
    ];
    let mut rows_list = vec![1usize, 8, 32, 128];
    let mut rows_given = false;
    let mut bandwidth_only = false;
    let mut attention_ctx: Vec<usize> = Vec::new();
    let mut stream_layers = 0usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--bandwidth-only" {
            bandwidth_only = true;
            continue;
        }
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--shape" => {
                shapes = v
                    .split(',')
                    .filter_map(|s| {
                        let (o, i) = s.split_once('x')?;
                        Some((o.parse().ok()?, i.parse().ok()?))
                    })
                    .collect()
            }
            "--rows" => {
                rows_list = v.split(',').filter_map(|s| s.parse().ok()).collect();
                rows_given = true;
            }
            "--attention" => attention_ctx = v.split(',').filter_map(|s| s.parse().ok()).collect(),
            "--decode-stream" => stream_layers = v.parse().unwrap_or(0),
            _ => {
                eprintln!(
                    "kernel-bench [--shape OUTxIN,...] [--rows 1,8,32] [--bandwidth-only] [--attention CTX,...] [--decode-stream LAYERS]"
                );
                std::process::exit(2);
            }
        }
    }
    let pool = Pool::global();
    if stream_layers > 0 {
        let rows = if rows_given { rows_list } else { vec![1] };
        return decode_stream(&shapes, stream_layers, &rows, pool);
    }
    if !attention_ctx.is_empty() {
        return attention_table(&attention_ctx, pool);
    }
    println!(
        "threads {}, best ISA {}",
        pool.threads(),
        Isa::detect().as_str()
    );
    let bw = read_bandwidth(pool);
    println!("read bandwidth {bw:.1} GB/s\n");
    if bandwidth_only {
        return;
    }
    println!(
        "| kernel | shape | rows | µs | GB/s | GMAC/s | time vs avx2 |\n|---|---|---|---|---|---|---|"
    );
    // The AVX2 kernel's time per (product, activations, shape, rows): the column every other
    // instruction set's row is compared with (measured in this run; "—" where AVX2 is absent).
    let mut avx2_us: std::collections::HashMap<String, f64> = Default::default();
    let mut vs_avx2 = |isa: Isa, key: String, us: f64| -> String {
        if isa == Isa::Avx2 {
            avx2_us.insert(key.clone(), us);
        }
        avx2_us
            .get(&key)
            .map_or("—".to_string(), |b| format!("{:.2}", us / b))
    };
    for &(o, i) in &shapes {
        let w: Vec<f32> = (0..o * i)
            .map(|k| ((k * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let wh: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
        for &m in &rows_list {
            let x: Vec<f32> = (0..m * i)
                .map(|k| ((k * 31) % 97) as f32 / 97.0 - 0.5)
                .collect();
            let mut out = vec![0f32; m * o];
            for isa in Isa::all_available() {
                // The weights in the order this instruction set's kernel reads, and for
                // AVX-512 also in the quad order its 8-bit-activation kernel reads.
                let p4 =
                    Weights::Q4(PackedQ4::quantize(&w, o, i).unwrap_or_else(|e| panic!("{e}")));
                let mut layouts = vec![(Q8Layout::for_isa(isa), isa.as_str().to_string())];
                if isa == Isa::Avx512 {
                    layouts.push((Q8Layout::WideQuadColumns, "avx512-quad".to_string()));
                }
                for (li, (layout, name)) in layouts.iter().enumerate() {
                    let p8 = Weights::Q8(
                        PackedQ8::quantize_in(&w, o, i, *layout).unwrap_or_else(|e| panic!("{e}")),
                    );
                    for (bits, four) in [
                        (ActBits::Eight, false),
                        (ActBits::Sixteen, false),
                        (ActBits::Eight, true),
                        (ActBits::Sixteen, true),
                    ] {
                        if four && li > 0 {
                            continue;
                        }
                        let p = if four { &p4 } else { &p8 };
                        let mut a = Activations::new();
                        let run = || {
                            a.quantize_with(&x, m, i, bits, isa)
                                .unwrap_or_else(|e| panic!("{e}"));
                            p.matmul(&a, &mut out, isa, pool);
                        };
                        let s = seconds_per_call(run);
                        let kind = if four { "q4" } else { "q8" };
                        let ratio = vs_avx2(isa, format!("{kind} {bits:?} {o}x{i} {m}"), s);
                        println!(
                            "| {kind} {name} {:?} | {o}x{i} | {m} | {:.1} | {:.1} | {:.1} | {ratio} |",
                            bits,
                            s * 1e6,
                            p.bytes() as f64 / s / 1e9,
                            (o * i * m) as f64 / s / 1e9
                        );
                    }
                }
                let s = seconds_per_call(|| {
                    f16_matmul(&wh, o, i, &x, &mut out, isa, pool).unwrap_or_else(|e| panic!("{e}"))
                });
                let ratio = vs_avx2(isa, format!("f16 {o}x{i} {m}"), s);
                println!(
                    "| f16 {} | {o}x{i} | {m} | {:.1} | {:.1} | {:.1} | {ratio} |",
                    isa.as_str(),
                    s * 1e6,
                    (2 * o * i) as f64 / s / 1e9,
                    (o * i * m) as f64 / s / 1e9
                );
            }
        }
    }
}

/// One decode row's attention over `ctx` positions, keys and values in f32 and in 8 bits,
/// on the pool's threads and on one.
fn attention_table(ctxs: &[usize], pool: &Pool) {
    let (heads, kv_heads, hd) = (9, 3, 64);
    println!(
        "threads {}, best ISA {}\n\n| attention | threads | keys | positions | µs | ns per position and head |\n|---|---|---|---|---|---|",
        pool.threads(),
        Isa::detect().as_str()
    );
    let one = Pool::new(1);
    for (&ctx, pool) in ctxs.iter().flat_map(|c| [(c, pool), (c, &one)]) {
        let n = kv_heads * ctx * hd;
        let k8: Vec<i8> = (0..n).map(|j| ((j * 37) % 255) as i8).collect();
        let v8: Vec<i8> = (0..n).map(|j| ((j * 91) % 251) as i8).collect();
        let kf: Vec<f32> = k8.iter().map(|&x| f32::from(x) * 0.01).collect();
        let vf: Vec<f32> = v8.iter().map(|&x| f32::from(x) * 0.01).collect();
        let scales = vec![0.01f32; kv_heads * ctx];
        let q: Vec<f32> = (0..heads * hd).map(|j| (j as f32 * 0.1).sin()).collect();
        let mut out = vec![0f32; q.len()];
        let shape = AttentionShape {
            rows: 1,
            start: ctx - 1,
            heads,
            kv_heads,
            head_dim: hd,
        };
        for isa in Isa::all_available() {
            for eight in [false, true] {
                let s = seconds_per_call(|| {
                    let r = if eight {
                        let kv = Contiguous {
                            k: &k8[..],
                            v: &v8[..],
                            k_scales: Some(&scales[..]),
                            v_scales: Some(&scales[..]),
                            keys: ctx,
                            head_dim: hd,
                        };
                        attention_over(&q, &kv, shape, &mut out, isa, pool)
                    } else {
                        let kv = Contiguous {
                            k: &kf[..],
                            v: &vf[..],
                            k_scales: None,
                            v_scales: None,
                            keys: ctx,
                            head_dim: hd,
                        };
                        attention_over(&q, &kv, shape, &mut out, isa, pool)
                    };
                    r.unwrap_or_else(|e| panic!("{e}"));
                });
                println!(
                    "| {} | {} | {} | {ctx} | {:.1} | {:.2} |",
                    isa.as_str(),
                    pool.threads(),
                    if eight { "8-bit" } else { "f32" },
                    s * 1e6,
                    s * 1e9 / (ctx * heads) as f64
                );
            }
        }
    }
}

/// One decode step's products over distinct matrices (`layers` times every shape but the
/// last, then the last once), back to back, against one product over a single matrix of the
/// same bytes: per instruction set, Q8_0 and 4-bit weights, 16- and 8-bit activations, at
/// each of `rows_list` activation rows.
fn decode_stream(shapes: &[(usize, usize)], layers: usize, rows_list: &[usize], pool: &Pool) {
    let Some((&last, per_layer)) = shapes.split_last() else {
        return;
    };
    let mut list: Vec<(usize, usize)> = (0..layers)
        .flat_map(|_| per_layer.iter().copied())
        .collect();
    list.push(last);
    let width = list.iter().map(|s| s.1).max().unwrap_or(0);
    let total_rows: usize = list.iter().map(|s| s.0 * s.1).sum::<usize>() / width;
    let values = |o: usize, i: usize, seed: usize| -> Vec<f32> {
        (0..o * i)
            .map(|k| (((k + seed) * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    };
    let x_row: Vec<f32> = (0..width)
        .map(|k| ((k * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    println!(
        "threads {}, best ISA {}; {} products ({layers} layers of {:?}, then {:?}) against one {total_rows}x{width}\n",
        pool.threads(),
        Isa::detect().as_str(),
        list.len(),
        per_layer,
        last
    );
    println!("| kernel | activations | rows | products | MB | µs per step | GB/s | GMAC/s | one product of the same bytes, µs | GB/s | time vs one | read bandwidth just before, GB/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|");
    let macs: usize = list.iter().map(|s| s.0 * s.1).sum();
    let most = list.iter().map(|s| s.0).max().unwrap_or(0).max(total_rows);
    for isa in Isa::all_available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
    {
        for (kind, bits) in [
            ("q8", ActBits::Sixteen),
            ("q8", ActBits::Eight),
            ("q4", ActBits::Sixteen),
            ("q4", ActBits::Eight),
        ] {
            // The order the engine packs for activations of this width.
            let layout = Q8Layout::for_width(isa, bits);
            let pack = |o: usize, i: usize, seed: usize| -> Weights {
                let w = values(o, i, seed);
                match kind {
                    "q8" => Weights::Q8(
                        PackedQ8::quantize_in(&w, o, i, layout).unwrap_or_else(|e| panic!("{e}")),
                    ),
                    _ => {
                        Weights::Q4(PackedQ4::quantize(&w, o, i).unwrap_or_else(|e| panic!("{e}")))
                    }
                }
            };
            let mats: Vec<Weights> = list
                .iter()
                .enumerate()
                .map(|(n, &(o, i))| pack(o, i, n))
                .collect();
            let bytes: usize = mats.iter().map(|m| m.bytes()).sum();
            let one = pack(total_rows, width, 0);
            for &rows in rows_list {
                let x: Vec<f32> = (0..rows).flat_map(|_| x_row.iter().copied()).collect();
                let mut acts: Vec<(usize, Activations)> = Vec::new();
                for &(_, i) in &list {
                    if !acts.iter().any(|(w, _)| *w == i) {
                        let xi: Vec<f32> = x.chunks(width).flat_map(|r| r[..i].to_vec()).collect();
                        let mut a = Activations::new();
                        a.quantize_with(&xi, rows, i, bits, isa)
                            .unwrap_or_else(|e| panic!("{e}"));
                        acts.push((i, a));
                    }
                }
                let act = |i: usize| {
                    &acts
                        .iter()
                        .find(|(w, _)| *w == i)
                        .unwrap_or_else(|| panic!("width {i}"))
                        .1
                };
                let mut out = vec![0f32; rows * most];
                let bw = read_bandwidth(pool);
                let stream = seconds_per_call(|| {
                    for (m, &(o, i)) in mats.iter().zip(&list) {
                        m.matmul(act(i), &mut out[..rows * o], isa, pool);
                    }
                });
                let single = seconds_per_call(|| {
                    one.matmul(act(width), &mut out[..rows * total_rows], isa, pool);
                });
                println!(
                    "| {kind} {} | {bits:?} | {rows} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {:.0} | {:.1} | {:.2} | {bw:.1} |",
                    isa.as_str(),
                    list.len(),
                    bytes as f64 / 1e6,
                    stream * 1e6,
                    bytes as f64 / stream / 1e9,
                    (macs * rows) as f64 / stream / 1e9,
                    single * 1e6,
                    one.bytes() as f64 / single / 1e9,
                    stream / single
                );
            }
        }
    }
}

/// The weights of one timed product, 8- or 4-bit.
enum Weights {
    Q8(PackedQ8),
    Q4(PackedQ4),
}

impl Weights {
    fn bytes(&self) -> usize {
        match self {
            Weights::Q8(w) => w.bytes(),
            Weights::Q4(w) => w.bytes(),
        }
    }

    fn matmul(&self, a: &Activations, out: &mut [f32], isa: Isa, pool: &Pool) {
        match self {
            Weights::Q8(w) => w.matmul(a, out, isa, pool),
            Weights::Q4(w) => w.matmul(a, out, isa, pool),
        }
        .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// A STREAM-like read: the pool's threads sum a 256 MiB buffer four times; GB/s.
fn read_bandwidth(pool: &Pool) -> f64 {
    let big = vec![1u8; 256 << 20];
    let t = Instant::now();
    let reps = 4;
    for _ in 0..reps {
        let parts: Vec<std::sync::atomic::AtomicU64> =
            (0..pool.threads()).map(|_| 0.into()).collect();
        pool.run(&|i, n| {
            let chunk = big.len() / n;
            let s: u64 = big[i * chunk..(i + 1) * chunk]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .fold(0u64, |a, b| a.wrapping_add(b));
            parts[i].store(s, std::sync::atomic::Ordering::Relaxed);
        });
    }
    (big.len() * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
}
