//! What reading a safetensors header costs: wall time and peak RSS of a bare serde_json walk
//! (the floor of any serde parse), of stcast's single-pass
//! `header::read_header`, then of the `safetensors` crate's `SafeTensors::read_metadata`
//! (which `read_header` is fuzzed against), on one file. Ours runs first, so the peak after
//! it is its own. The many-tensors evidence: a 300,000-tensor header of 33.8 MB took the
//! crate about 0.5 s and 294 MB at peak.
//!
//! `cargo bench --bench header_rss -- FILE` (make FILE with `benches/compare.py
//! --many-tensors`, or any safetensors file).

use std::fs::File;
use std::time::Instant;

/// VmHWM and VmRSS of this process, in kB.
fn peaks() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .filter(|l| l.starts_with("VmHWM:") || l.starts_with("VmRSS:"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn main() {
    // `cargo bench` passes `--bench`; the file is the first other argument.
    let Some(path) = std::env::args().skip(1).find(|a| !a.starts_with("--")) else {
        eprintln!("usage: cargo bench --bench header_rss -- FILE");
        std::process::exit(2);
    };
    let file = File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    // SAFETY: read-only map of a file this process does not modify; a benchmark probe.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap_or_else(|e| panic!("{path}: {e}"));
    println!("before: {}", peaks());
    // The floor of any serde_json pass: the JSON walked and checked, nothing kept.
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    let started = Instant::now();
    let text = std::str::from_utf8(&map[8..8 + n]).expect("UTF-8");
    serde_json::from_str::<serde::de::IgnoredAny>(text).expect("JSON");
    println!(
        "serde_json IgnoredAny: {:.3?} (UTF-8 check and JSON walk, nothing kept); {}",
        started.elapsed(),
        peaks()
    );
    let started = Instant::now();
    let ours = stcast::header::read_header(std::path::Path::new(&path), &map[..])
        .unwrap_or_else(|e| panic!("{e}"));
    let took = started.elapsed();
    println!(
        "stcast read_header: {took:.3?} for a {}-byte header, {} tensors; {}",
        ours.header_len,
        ours.tensors.len(),
        peaks()
    );
    drop(ours);
    let started = Instant::now();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&map[..])
        .unwrap_or_else(|e| panic!("{path}: {e:?}"));
    let took = started.elapsed();
    println!(
        "read_metadata: {took:.3?} for a {n}-byte header, {} tensors; {}",
        meta.tensors().len(),
        peaks()
    );
    drop(meta);
    println!("after drop: {}", peaks());
}
