//! What the checkpoint-folder property tests share (`dcp_input.rs`, `zero_input.rs`):
//! reading every tensor back whole and in windows, and mutating a copy's files (bytes
//! flipped or cut) from a fixed, printed seed (`STCAST_PROPTEST_SEED` replays another).

use std::path::PathBuf;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use stcast::Source;

/// Every tensor of `src`, whole and in windows of `step` elements (the two must agree).
pub fn read_all(src: &Source, step: u64) -> stcast::Result<Vec<(String, Vec<u8>)>> {
    let mut scratch = Vec::new();
    let mut out = Vec::new();
    for t in &src.header.tensors {
        let es = (t.dtype.bitsize() / 8).max(1) as u64;
        let whole = src.read(t, 0, t.len(), &mut scratch)?.to_vec();
        let mut parts = Vec::new();
        let mut at = 0;
        while at < t.len() {
            let n = (step * es).min(t.len() - at);
            parts.extend_from_slice(src.read(t, at, n, &mut scratch)?);
            at += n;
        }
        assert_eq!(parts, whole, "`{}`", t.name);
        out.push((t.name.clone(), whole));
    }
    Ok(out)
}

#[derive(Debug, Clone)]
pub enum Mutation {
    /// XOR a byte of the file at a position (a fraction of its length).
    Flip { file: usize, at: f64, mask: u8 },
    /// Cut the file at a fraction of its length.
    Cut { file: usize, at: f64 },
}

/// A mutation of one of `files` files (the index is taken modulo the files there are).
pub fn mutation(files: usize) -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0..files, 0.0..1.0f64, 1..=255u8).prop_map(|(file, at, mask)| Mutation::Flip {
            file,
            at,
            mask
        }),
        (0..files, 0.0..1.0f64).prop_map(|(file, at)| Mutation::Cut { file, at }),
    ]
}

/// Apply `mutations` to `files` (sorted, so that a seed replays the same case).
pub fn apply(files: &[PathBuf], mutations: &[Mutation]) {
    for m in mutations {
        let (file, at) = match m {
            Mutation::Flip { file, at, .. } | Mutation::Cut { file, at } => (*file, *at),
        };
        let path = &files[file % files.len()];
        let mut data = std::fs::read(path).unwrap();
        let pos = ((data.len() as f64) * at) as usize;
        match m {
            Mutation::Flip { mask, .. } if pos < data.len() => data[pos] ^= mask,
            Mutation::Cut { .. } => data.truncate(pos),
            _ => {}
        }
        std::fs::write(path, data).unwrap();
    }
}

/// A runner of `cases` cases from `STCAST_PROPTEST_SEED`, or `default_seed`, printed.
pub fn runner(name: &str, default_seed: u64, cases: u32) -> TestRunner {
    let seed = std::env::var("STCAST_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(default_seed);
    println!("{name}: proptest ChaCha seed {seed} (STCAST_PROPTEST_SEED)");
    let mut bytes = [0u8; 32];
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&seed.to_le_bytes());
    }
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}
