//! Where one conversion's time and memory go, phase by phase: open (map and validate the
//! header), new (check the destination, plan, create the output and write its header),
//! the steps (the data), seal and publish, with the peak RSS after each. The many-tensors
//! evidence: `benches/gen.py 300000x1024 FILE`, then
//!
//! `cargo bench --bench phases -- FILE OUT` (OUT is replaced).

use std::path::Path;
use std::time::Instant;

use stcast::convert::Options;
use stcast::task::Task;

/// VmHWM of this process.
fn peak() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() {
    // `cargo bench` passes `--bench`; the files are the other arguments.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let [src, dst] = &args[..] else {
        eprintln!("usage: cargo bench --bench phases -- FILE OUT");
        std::process::exit(2);
    };
    let opts = Options {
        force: true,
        ..Options::default()
    };
    let t = Instant::now();
    let source = stcast::Source::open_any(Path::new(src), &opts.input).expect("open");
    println!("open     {:>10.3?}  peak {}", t.elapsed(), peak());
    let t = Instant::now();
    let mut task = stcast::ConvertTask::from_source(source, Path::new(dst), &opts, Instant::now())
        .expect("plan");
    println!("new      {:>10.3?}  peak {}", t.elapsed(), peak());
    let t = Instant::now();
    while !task.step(64 << 20).expect("step") {}
    println!("steps    {:>10.3?}  peak {}", t.elapsed(), peak());
    let t = Instant::now();
    task.seal().expect("seal");
    let report = task.publish().expect("publish");
    println!("publish  {:>10.3?}  peak {}", t.elapsed(), peak());
    let t = Instant::now();
    drop(report);
    println!("drop     {:>10.3?}", t.elapsed());
}
