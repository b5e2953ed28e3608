//! DeepSpeed ZeRO folders as engine sources (`Source::open_any`), without Python: the real
//! DeepSpeed 0.19.8 fixtures read back (whole, and in windows of any size) as zero_to_fp32
//! rebuilds them, and mutated ones (bytes flipped or cut in the model and optimizer states)
//! never panic the reader or the gather: each is read, or refused with a one-line error.
//! From a fixed, printed seed (`STCAST_PROPTEST_SEED` replays another).

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use stcast::input::InputOptions;
use stcast::Source;

const REAL: [&str; 2] = ["stage2-3ranks", "stage3-3ranks"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/zero")
        .join(name)
}

/// A copy of the fixture's checkpoint (`latest`, `global_step1/`) in a fresh folder.
fn copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-zero-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("global_step1")).unwrap();
    std::fs::copy(fixture(name).join("latest"), dir.join("latest")).unwrap();
    for e in std::fs::read_dir(fixture(name).join("global_step1")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join("global_step1").join(p.file_name().unwrap())).unwrap();
    }
    dir
}

/// Every tensor of `src`, whole and in windows of `step` elements.
fn read_all(src: &Source, step: u64) -> stcast::Result<Vec<(String, Vec<u8>)>> {
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

#[test]
fn real_checkpoints_read_back_as_zero_to_fp32_rebuilds_them() {
    for name in REAL {
        let dir = copy(name, name);
        for src_dir in [dir.clone(), dir.join("global_step1")] {
            let src = Source::open_any(&src_dir, &InputOptions::default()).unwrap();
            let want_bytes =
                std::fs::read(fixture(name).join("expected-fp32.safetensors")).unwrap();
            let want = safetensors::SafeTensors::deserialize(&want_bytes).unwrap();
            assert_eq!(src.header.tensors.len(), want.len(), "{name}");
            for step in [1, 4, 1 << 20] {
                for (n, bytes) in read_all(&src, step).unwrap() {
                    let w = want.tensor(&n).unwrap();
                    assert_eq!(bytes, w.data(), "{name} `{n}`");
                    let t = src.header.tensors.iter().find(|t| t.name == n).unwrap();
                    assert_eq!(t.shape, w.shape(), "{name} `{n}`");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    /// XOR a byte of the file at a position (a fraction of its length).
    Flip { file: usize, at: f64, mask: u8 },
    /// Cut the file at a fraction of its length.
    Cut { file: usize, at: f64 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0..6usize, 0.0..1.0f64, 1..=255u8).prop_map(|(file, at, mask)| Mutation::Flip {
            file,
            at,
            mask
        }),
        (0..6usize, 0.0..1.0f64).prop_map(|(file, at)| Mutation::Cut { file, at }),
    ]
}

#[test]
fn mutated_checkpoints_never_panic() {
    let seed = std::env::var("STCAST_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0x2e50_5eed);
    println!("zero mutations: proptest ChaCha seed {seed} (STCAST_PROPTEST_SEED)");
    let mut bytes = [0u8; 32];
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&seed.to_le_bytes());
    }
    let config = Config {
        cases: 300,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes));
    let case = (0..REAL.len(), proptest::collection::vec(mutation(), 1..4));
    let (read, refused) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    runner
        .run(&case, |(which, mutations)| {
            let dir = copy(REAL[which], "mutated");
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("global_step1"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            files.sort();
            for m in &mutations {
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
            match Source::open_any(&dir, &InputOptions::default()).and_then(|s| read_all(&s, 5)) {
                Ok(_) => read.set(read.get() + 1),
                Err(e) => {
                    let text = e.to_string();
                    prop_assert!(!text.contains('\n'), "{text}");
                    refused.set(refused.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(
        std::env::temp_dir().join(format!("stcast-zero-{}-mutated", std::process::id())),
    );
    println!(
        "zero mutations: {} read, {} refused",
        read.get(),
        refused.get()
    );
    assert!(refused.get() > 0);
}
