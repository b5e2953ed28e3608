//! Kernel throughput per ISA beside memcpy: `cargo bench --bench kernels [-- LARGE_MIB]`.
//!
//! Prints Markdown tables of GB/s of input (1 GB = 1e9 bytes), best of 5 runs: f32 -> bf16
//! for a cache-resident 1 MiB input and a large one (256 MiB unless given), on one thread
//! and on every thread, beside memcpy and a plain read of the same bytes; then the other
//! kernels on one thread; then each kernel alone and fused with `numerics::measure`, as a
//! conversion runs them (the numeric report's cost).
use std::hint::black_box;
use std::time::{Duration, Instant};

use stcast::kernels::{f16_to_bf16, f32_to_bf16, f32_to_f16, f64_to_bf16, f64_to_f16, Isa};
use stcast::numerics;
use stcast::Conversion;

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
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut src = Vec::with_capacity(bytes + 8);
    while src.len() < bytes {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let value = (state >> 11) as f64 / (1u64 << 42) as f64 - 1024.0;
        match src_elem {
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
    let large_mib: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(256);
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

    numerics_table(large_mib, small_reps);
}

/// The numeric report's cost: each kernel alone, then fused with `numerics::measure` the
/// way a conversion runs them (kernel then measure, per 16 KiB of input, while in cache).
fn numerics_table(large_mib: usize, small_reps: usize) {
    const SUB: usize = 16 << 10;
    let isa = Isa::detect();
    println!(
        "\n| numerics, 1 thread, {} | 1 MiB | {large_mib} MiB |",
        isa.name()
    );
    println!("|---|---:|---:|");
    let all: [(&str, Kernel, Conversion); 5] = [
        ("f32_to_bf16", f32_to_bf16, Conversion::F32ToBf16),
        ("f16_to_bf16", f16_to_bf16, Conversion::F16ToBf16),
        ("f64_to_bf16", f64_to_bf16, Conversion::F64ToBf16),
        ("f32_to_f16", f32_to_f16, Conversion::F32ToF16),
        ("f64_to_f16", f64_to_f16, Conversion::F64ToF16),
    ];
    for (name, kernel, conv) in all {
        let src_elem = conv.src_size() as usize;
        let small = input(1 << 20, src_elem);
        let large = input(large_mib << 20, src_elem);
        let rate = |src: &[u8], reps: usize, measured: bool| {
            let mut dst = vec![1u8; src.len() / src_elem * 2];
            let mut best = Duration::MAX;
            for round in 0..6 {
                let start = Instant::now();
                for _ in 0..reps {
                    let pieces = src.chunks(SUB).zip(dst.chunks_mut(SUB / src_elem * 2));
                    for (s, d) in pieces {
                        kernel(isa, black_box(s), d);
                        if measured {
                            black_box(numerics::measure(conv, s, d));
                        }
                    }
                }
                if round > 0 {
                    best = best.min(start.elapsed());
                }
            }
            (src.len() * reps) as f64 / best.as_secs_f64() / 1e9
        };
        for measured in [false, true] {
            let label = format!("{name}{}", if measured { " + measure" } else { "" });
            let cells = [
                rate(&small, small_reps, measured),
                rate(&large, 1, measured),
            ];
            let cells: Vec<String> = cells.iter().map(|g| format!("{g:.1}")).collect();
            println!("| {label} | {} |", cells.join(" | "));
        }
    }
}
