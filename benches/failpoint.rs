//! What a compiled-in failpoint costs when it is not armed: `cargo bench --bench failpoint`.
//!
//! The conversion hits `mid-tensor` at most once per file and the other points once per
//! file, so the cost per window is nothing; this measures the cost per hit anyway, beside
//! the time one 8 MiB window takes, to show it is far below anything measurable.

use std::hint::black_box;
use std::time::Instant;

fn main() {
    const HITS: u32 = 50_000_000;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..HITS {
            black_box(stcast::failpoint::hit(black_box("mid-tensor"))).unwrap();
        }
        best = best.min(t.elapsed().as_secs_f64() / f64::from(HITS));
    }
    // One 8 MiB window of F32 at 10 GB/s (faster than this machine's memory) takes 0.84 ms.
    let window = (8u64 << 20) as f64 / 10e9;
    println!(
        "unarmed failpoint: {:.2} ns per hit (best of 5 x {HITS}); one 8 MiB window at 10 GB/s: \
         {:.0} us; a hit per window would cost {:.1e} of it",
        best * 1e9,
        window * 1e6,
        best / window
    );
}
