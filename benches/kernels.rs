//! Kernel throughput per ISA beside memcpy: `cargo bench --bench kernels [-- LARGE_MIB]`.
//!
//! Prints Markdown tables of GB/s of input (1 GB = 1e9 bytes), best of 5 runs: f32 -> bf16
//! for a cache-resident 1 MiB input and a large one (256 MiB unless given), on one thread
//! and on every thread, beside memcpy and a plain read of the same bytes; then the other
//! kernels on one thread. Then the numeric report's cost, per conversion and ISA, median
//! [min-max] of interleaved rounds: the kernel alone, the kernel then `numerics::measure`
//! per 16 KiB (as `convert` runs them), and `fused::convert_and_measure`.
//!
//! Last, FP8 (`stcast::fp8`) on a 4096 x 4096 weight; `-- --fp8` prints only that table.
//!
//! `-- --numerics[=CONV] [--rounds=N]` prints only that table; `-- --job=CONV,ISA,JOB,MIB`
//! runs one of its jobs once, for instruction counts:
//! `valgrind --tool=callgrind --toggle-collect='*run_numerics_job*' BENCH --job=...`.
use std::hint::black_box;
use std::time::{Duration, Instant};

use stcast::kernels::{
    bf16_to_f16, f16_to_bf16, f32_to_bf16, f32_to_f16, f64_to_bf16, f64_to_f16, Isa,
};
use stcast::Conversion;
use stcast::{fused, numerics};

type Kernel = fn(Isa, &[u8], &mut [u8]);

/// One way to consume `src` (and fill `dst`).
#[derive(Clone, Copy)]
enum Job {
    Memcpy,
    /// Reads every input byte and writes nothing: the floor for a kernel in memory.
    Read,
    Kernel {
        name: &'static str,
        kernel: Kernel,
        src_elem: usize,
        isa: Isa,
    },
}

impl Job {
    fn label(self) -> String {
        match self {
            Job::Memcpy => "memcpy (same input bytes)".to_string(),
            Job::Read => "read only (xor of the input)".to_string(),
            Job::Kernel { name, isa, .. } => format!("{name} {}", isa.name()),
        }
    }

    fn dst_len(self, src_len: usize) -> usize {
        match self {
            Job::Memcpy => src_len,
            Job::Read => 64,
            Job::Kernel { src_elem, .. } => src_len / src_elem * 2,
        }
    }

    fn run(self, src: &[u8], dst: &mut [u8]) {
        match self {
            Job::Memcpy => dst.copy_from_slice(src),
            Job::Read => {
                let mut acc = [0u64; 8];
                for line in src.as_chunks::<64>().0 {
                    for (a, word) in acc.iter_mut().zip(line.as_chunks::<8>().0) {
                        *a ^= u64::from_le_bytes(*word);
                    }
                }
                for (d, a) in dst.as_chunks_mut::<8>().0.iter_mut().zip(acc) {
                    *d = a.to_le_bytes();
                }
            }
            Job::Kernel { kernel, isa, .. } => kernel(isa, src, dst),
        }
    }
}

/// `bytes` of ordinary values of the element size (the kernels are branch-free over
/// values, except the scalar f16/f64 fallbacks, which see realistic data this way).
fn input(bytes: usize, src_elem: usize) -> Vec<u8> {
    input_of(bytes, src_elem, false)
}

/// As `input`, with 2-byte elements in bf16 when `bf16`.
fn input_of(bytes: usize, src_elem: usize, bf16: bool) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut src = Vec::with_capacity(bytes + 8);
    while src.len() < bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let value = (state >> 11) as f64 / (1u64 << 42) as f64 - 1024.0;
        match src_elem {
            2 if bf16 => src.extend_from_slice(&bf16_bits(value as f32).to_le_bytes()),
            2 => src.extend_from_slice(&f16_bits(value as f32).to_le_bytes()),
            4 => src.extend_from_slice(&(value as f32).to_le_bytes()),
            _ => src.extend_from_slice(&value.to_le_bytes()),
        }
    }
    src.truncate(bytes);
    src
}

fn f16_bits(x: f32) -> u16 {
    stcast::kernels::f16_from_f32(x.to_bits())
}

fn bf16_bits(x: f32) -> u16 {
    stcast::kernels::bf16_from_f32(x.to_bits())
}

/// Best GB/s of input over 5 timed rounds (after an untimed one that warms caches and
/// faults pages in). Each round every thread runs `reps` times over its part of `src`, or,
/// with `private`, over its own copy of all of it.
fn measure(job: Job, src: &[u8], threads: usize, private: bool, reps: usize) -> f64 {
    let copies: Vec<Vec<u8>> = if private {
        (0..threads).map(|_| src.to_vec()).collect()
    } else {
        Vec::new()
    };
    let parts: Vec<&[u8]> = if private {
        copies.iter().map(Vec::as_slice).collect()
    } else {
        src.chunks(src.len().div_ceil(threads).next_multiple_of(64))
            .collect()
    };
    let mut dsts: Vec<Vec<u8>> = parts
        .iter()
        .map(|p| vec![1; job.dst_len(p.len())])
        .collect();
    let bytes = parts.iter().map(|p| p.len()).sum::<usize>() * reps;
    let mut best = Duration::MAX;
    for round in 0..6 {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for (part, dst) in parts.iter().zip(dsts.iter_mut()) {
                scope.spawn(move || {
                    for _ in 0..reps {
                        job.run(black_box(part), black_box(dst));
                    }
                });
            }
        });
        if round > 0 {
            best = best.min(start.elapsed());
        }
    }
    bytes as f64 / best.as_secs_f64() / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let large_mib: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(256);
    let rounds: usize = args
        .iter()
        .find_map(|a| a.strip_prefix("--rounds=")?.parse().ok())
        .unwrap_or(11);
    // `--job=CONV,ISA,JOB,MIB`: run one numerics job once, for instruction counts:
    // valgrind --tool=callgrind --toggle-collect='*run_numerics_job*' BENCH --job=...
    if let Some(spec) = args.iter().find_map(|a| a.strip_prefix("--job=")) {
        one_job(spec);
        return;
    }
    // `--fp8`: only the FP8 table.
    if args.iter().any(|a| a == "--fp8") {
        fp8_table();
        return;
    }
    // `--numerics[=f32_to_bf16]`: only the numerics table (for one conversion).
    if let Some(arg) = args.iter().find(|a| a.starts_with("--numerics")) {
        let only = arg.strip_prefix("--numerics=");
        numerics_table(large_mib, 256, rounds, only);
        return;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let small_reps = 256;
    let row = |label: String, cells: &[f64]| {
        let cells: Vec<String> = cells.iter().map(|g| format!("{g:.1}")).collect();
        println!("| {label} | {} |", cells.join(" | "));
    };

    println!(
        "Isa::detect() = {}; {threads} threads; GB/s of input, best of 5\n",
        Isa::detect().name()
    );
    println!(
        "| job | 1 MiB, 1 thread | 1 MiB, {threads} threads | {large_mib} MiB, 1 thread | \
         {large_mib} MiB, {threads} threads |"
    );
    println!("|---|---:|---:|---:|---:|");
    let small = input(1 << 20, 4);
    let large = input(large_mib << 20, 4);
    let mut jobs = vec![Job::Memcpy, Job::Read];
    jobs.extend(Isa::available().into_iter().map(|isa| Job::Kernel {
        name: "f32_to_bf16",
        kernel: f32_to_bf16,
        src_elem: 4,
        isa,
    }));
    for job in jobs {
        let cells = [
            measure(job, &small, 1, true, small_reps),
            measure(job, &small, threads, true, small_reps),
            measure(job, &large, 1, false, 1),
            measure(job, &large, threads, false, 1),
        ];
        row(job.label(), &cells);
    }
    drop(large);

    println!("\n| other kernels, 1 thread | 1 MiB | {large_mib} MiB |");
    println!("|---|---:|---:|");
    let others: [(&str, Kernel, usize); 4] = [
        ("f16_to_bf16", f16_to_bf16, 2),
        ("f64_to_bf16", f64_to_bf16, 8),
        ("f32_to_f16", f32_to_f16, 4),
        ("f64_to_f16", f64_to_f16, 8),
    ];
    for (name, kernel, src_elem) in others {
        let small = input(1 << 20, src_elem);
        let large = input(large_mib << 20, src_elem);
        for isa in Isa::available() {
            let job = Job::Kernel {
                name,
                kernel,
                src_elem,
                isa,
            };
            let cells = [
                measure(job, &small, 1, true, small_reps),
                measure(job, &large, 1, false, 1),
            ];
            row(job.label(), &cells);
        }
    }

    numerics_table(large_mib, small_reps, rounds, None);
    fp8_table();
}

/// FP8 quantization and dequantization of a 4096 x 4096 weight on one thread, GB/s of
/// input (the weight for quantization, the e4m3 bytes for dequantization), best of 5 after
/// a warm-up round: per-row (FP8_DYNAMIC) over all rows in one call, 128x128 blocks
/// (FP8_BLOCK) band by band, dequantization to bf16, and the non-finite check.
fn fp8_table() {
    use safetensors::tensor::Dtype;
    use stcast::fp8;
    const N: usize = 4096;
    let best = |bytes: usize, f: &mut dyn FnMut()| {
        f();
        let t = (0..5)
            .map(|_| {
                let start = Instant::now();
                f();
                start.elapsed()
            })
            .min()
            .unwrap_or(Duration::MAX);
        bytes as f64 / t.as_secs_f64() / 1e9
    };
    println!("\n| fp8, {N} x {N}, 1 thread | GB/s of input |");
    println!("|---|---:|");
    let mut q = vec![0u8; N * N];
    for (d, name, size) in [
        (Dtype::F32, "f32", 4),
        (Dtype::BF16, "bf16", 2),
        (Dtype::F16, "f16", 2),
    ] {
        // Values of +-1024 scaled to ordinary weight magnitudes per element size.
        let src = input_of(N * N * size, size, d == Dtype::BF16);
        let mut scales = vec![0u8; N * size];
        let g = best(src.len(), &mut || {
            black_box(fp8::quantize_channel(d, N, &src, &mut q, &mut scales));
        });
        println!("| quantize_channel {name} | {g:.2} |");
        let mut bscales = vec![0u8; N.div_ceil(128) * size];
        let g = best(src.len(), &mut || {
            for (band, qb) in src.chunks(128 * N * size).zip(q.chunks_mut(128 * N)) {
                black_box(fp8::quantize_band(d, N, band, qb, &mut bscales));
            }
        });
        println!("| quantize_band {name} (per 128-row band) | {g:.2} |");
        let g = best(src.len(), &mut || {
            black_box(fp8::has_nonfinite(d, &src));
        });
        println!("| has_nonfinite {name} | {g:.2} |");
    }
    let src = input_of(N * N * 4, 4, false);
    let mut scales = vec![0u8; N * 4];
    fp8::quantize_channel(Dtype::F32, N, &src, &mut q, &mut scales);
    let mut dst = vec![0u8; 2 * N * N];
    for (s_dtype, name) in [
        (Dtype::F32, "f32"),
        (Dtype::BF16, "bf16"),
        (Dtype::F16, "f16"),
    ] {
        let g = best(q.len(), &mut || {
            fp8::dequantize(
                fp8::ScaleLayout::Channel,
                s_dtype,
                &scales,
                None,
                N,
                0,
                &q,
                Dtype::BF16,
                &mut dst,
            );
            black_box(&dst);
        });
        println!("| dequantize channel, {name} scales -> bf16 | {g:.2} |");
    }
    let block = fp8::ScaleLayout::Block {
        rows: 128,
        cols: 128,
    };
    let g = best(q.len(), &mut || {
        fp8::dequantize(
            block,
            Dtype::F32,
            &scales[..32 * 32 * 4],
            None,
            N,
            0,
            &q,
            Dtype::BF16,
            &mut dst,
        );
        black_box(&dst);
    });
    println!("| dequantize 128x128 blocks, f32 scales -> bf16 | {g:.2} |");
}

/// The numeric report's cost, per ISA: the kernel alone; the kernel then
/// `numerics::measure` per 16 KiB of input, as `convert` runs them today; and
/// `fused::convert_and_measure`, over the whole buffer in one call and per 16 KiB piece.
/// Rounds interleave the jobs (A B C D A B C D ...) so that they share the machine's
/// noise; each cell is the median GB/s of input over the rounds, with the lowest and
/// highest in brackets.
fn numerics_table(large_mib: usize, small_reps: usize, rounds: usize, only: Option<&str>) {
    const SUB: usize = 16 << 10;
    println!(
        "\n| numerics, 1 thread, median [min-max] of {rounds} rounds | 1 MiB | {large_mib} MiB |"
    );
    println!("|---|---:|---:|");
    for (name, kernel, conv) in CONVERSIONS {
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let src_elem = conv.src_size() as usize;
        let bf16 = conv == Conversion::Bf16ToF16;
        let sizes = [
            (input_of(1 << 20, src_elem, bf16), small_reps),
            (input_of(large_mib << 20, src_elem, bf16), 1),
        ];
        for isa in Isa::available() {
            let labels = ["kernel", "kernel + measure", "fused", "fused per 16 KiB"];
            let mut cells = vec![Vec::new(); labels.len()];
            for (src, reps) in &sizes {
                let mut dst = vec![1u8; src.len() / src_elem * 2];
                let mut times = vec![Vec::new(); labels.len()];
                for round in 0..=rounds {
                    for (job, t) in times.iter_mut().enumerate() {
                        let start = Instant::now();
                        for _ in 0..*reps {
                            run_numerics_job(job, isa, kernel, conv, black_box(src), &mut dst, SUB);
                        }
                        // Round 0 warms caches and faults the pages in.
                        if round > 0 {
                            t.push(start.elapsed());
                        }
                    }
                }
                for (cell, t) in cells.iter_mut().zip(&mut times) {
                    t.sort();
                    let gbs = |d: &Duration| (src.len() * reps) as f64 / d.as_secs_f64() / 1e9;
                    cell.push(format!(
                        "{:.1} [{:.1}-{:.1}]",
                        gbs(&t[t.len() / 2]),
                        gbs(&t[t.len() - 1]),
                        gbs(&t[0])
                    ));
                }
            }
            for (label, cell) in labels.iter().zip(cells) {
                println!("| {name} {} {label} | {} |", isa.name(), cell.join(" | "));
            }
        }
    }
}

/// The conversions of the numerics table.
const CONVERSIONS: [(&str, Kernel, Conversion); 6] = [
    ("f32_to_bf16", f32_to_bf16, Conversion::F32ToBf16),
    ("f16_to_bf16", f16_to_bf16, Conversion::F16ToBf16),
    ("f64_to_bf16", f64_to_bf16, Conversion::F64ToBf16),
    ("f32_to_f16", f32_to_f16, Conversion::F32ToF16),
    ("f64_to_f16", f64_to_f16, Conversion::F64ToF16),
    ("bf16_to_f16", bf16_to_f16, Conversion::Bf16ToF16),
];

/// `CONV,ISA,JOB,MIB` (e.g. `f32_to_bf16,avx2,2,16`): one run of job JOB (0 kernel,
/// 1 kernel + measure, 2 fused, 3 fused per 16 KiB) over MIB MiB of input.
fn one_job(spec: &str) {
    let parts: Vec<&str> = spec.split(',').collect();
    let [conv, isa, job, mib] = parts[..] else {
        panic!("--job=CONV,ISA,JOB,MIB, not {spec}");
    };
    let (_, kernel, conv) = *CONVERSIONS
        .iter()
        .find(|c| c.0 == conv)
        .expect("conversion");
    let isa = *Isa::available()
        .iter()
        .find(|i| i.name() == isa)
        .expect("isa on this CPU");
    let (job, mib): (usize, usize) = (job.parse().expect("job"), mib.parse().expect("MiB"));
    let src_elem = conv.src_size() as usize;
    let src = input_of(mib << 20, src_elem, conv == Conversion::Bf16ToF16);
    let mut dst = vec![1u8; src.len() / src_elem * 2];
    run_numerics_job(job, isa, kernel, conv, &src, &mut dst, 16 << 10);
    println!("{} elements", src.len() / src_elem);
    println!("{:?}", numerics::measure(conv, &src, &dst));
}

/// One numerics job over `src` (see numerics_table).
#[inline(never)]
fn run_numerics_job(
    job: usize,
    isa: Isa,
    kernel: Kernel,
    conv: Conversion,
    src: &[u8],
    dst: &mut [u8],
    sub: usize,
) {
    let src_elem = conv.src_size() as usize;
    let pieces = src.chunks(sub).zip(dst.chunks_mut(sub / src_elem * 2));
    match job {
        0 => kernel(isa, src, dst),
        1 => {
            for (s, d) in pieces {
                kernel(isa, s, d);
                black_box(numerics::measure_with(isa, conv, s, d));
            }
        }
        2 => {
            black_box(fused::convert_and_measure(isa, conv, src, dst));
        }
        _ => {
            for (s, d) in pieces {
                black_box(fused::convert_and_measure(isa, conv, s, d));
            }
        }
    }
}
