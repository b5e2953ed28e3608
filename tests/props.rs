//! Properties of the validate-and-plan path, from a fixed, printed seed (a few seconds).
//!
//! Arbitrary bytes, length-prefixed bytes, JSON-shaped headers with wrong fields and
//! mutated valid files must never panic `read_header` or `plan`; generated valid files must
//! be accepted and round-trip (plan -> in-memory conversion -> `read_header` gives the same
//! names, shapes and metadata, with contiguous, aligned offsets). The checks themselves are
//! `fuzz/check.rs`, shared with the fuzz target. Replay or explore with
//! `STCAST_PROPTEST_SEED=<u64> cargo test --test props -- --nocapture`.

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

#[path = "../fuzz/check.rs"]
mod check;

const DEFAULT_SEED: u64 = 0x57ca_57f0_22ed_5eed;

/// Every dtype of the format with its bits per element, plus names it must refuse.
const DTYPES: [(&str, usize); 22] = [
    ("BOOL", 8),
    ("U8", 8),
    ("I8", 8),
    ("F8_E5M2", 8),
    ("F8_E4M3", 8),
    ("F8_E8M0", 8),
    ("F8_E4M3FNUZ", 8),
    ("F8_E5M2FNUZ", 8),
    ("I16", 16),
    ("U16", 16),
    ("F16", 16),
    ("BF16", 16),
    ("I32", 32),
    ("U32", 32),
    ("F32", 32),
    ("C64", 64),
    ("F64", 64),
    ("I64", 64),
    ("U64", 64),
    ("F4", 4),
    ("F6_E2M3", 6),
    ("F6_E3M2", 6),
];
const BAD_DTYPES: [&str; 4] = ["f32", "F128", "", "F8"];

fn runner(name: &str, cases: u32) -> TestRunner {
    let seed = std::env::var("STCAST_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(DEFAULT_SEED);
    println!("{name}: {cases} cases, proptest ChaCha seed {seed} (STCAST_PROPTEST_SEED)");
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

/// Run `check` on every generated file; `must_accept` also requires `read_header` to accept it.
fn run(name: &str, cases: u32, files: impl Strategy<Value = Vec<u8>>, must_accept: bool) {
    let accepted = std::cell::Cell::new(0);
    let result = runner(name, cases).run(&files, |data| {
        let ok = check::check(&data);
        accepted.set(accepted.get() + usize::from(ok));
        prop_assert!(ok || !must_accept, "a valid file was refused");
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!("{name}: {} of {cases} files were valid", accepted.get());
}

fn prefixed(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.extend_from_slice(data);
    v
}

#[test]
fn arbitrary_bytes_never_panic() {
    run("bytes", 3000, vec(any::<u8>(), 0..300), false);
}

#[test]
fn arbitrary_bytes_behind_a_right_length_never_panic() {
    let files = (vec(any::<u8>(), 0..200), any::<prop::sample::Index>()).prop_map(|(body, at)| {
        let n = at.index(body.len() + 1);
        prefixed(&body[..n], &body[n..])
    });
    run("prefixed", 3000, files, false);
}

/// A JSON value that is a plausible, often wrong, header field.
fn json_number() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..40).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("1.5".to_string()),
        Just("1e3".to_string()),
        Just("\"4\"".to_string()),
        Just("null".to_string()),
        Just("18446744073709551616".to_string()),
    ]
}

fn json_list(item: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    prop_oneof![
        8 => vec(item, 0..4).prop_map(|v| format!("[{}]", v.join(","))),
        1 => Just("{}".to_string()),
        1 => Just("\"x\"".to_string()),
    ]
}

fn tensor_entry() -> impl Strategy<Value = String> {
    let dtype = prop_oneof![
        8 => (0..DTYPES.len()).prop_map(|i| format!("\"{}\"", DTYPES[i].0)),
        1 => (0..BAD_DTYPES.len()).prop_map(|i| format!("\"{}\"", BAD_DTYPES[i])),
        1 => json_number(),
    ];
    let fields = (
        dtype,
        json_list(json_number()),
        json_list(json_number()),
        any::<u8>(),
    );
    prop_oneof![
        9 => fields.prop_map(|(dtype, shape, offsets, drop)| {
            let mut parts = vec![
                format!("\"dtype\":{dtype}"),
                format!("\"shape\":{shape}"),
                format!("\"data_offsets\":{offsets}"),
            ];
            match drop % 8 {
                0 => {
                    parts.remove(usize::from(drop / 8) % 3);
                }
                1 => parts.push("\"extra\":1".to_string()),
                2 => parts.reverse(),
                _ => {}
            }
            format!("{{{}}}", parts.join(","))
        }),
        1 => json_number(),
    ]
}

fn metadata_entry() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => vec(("[a-z_]{0,4}", prop_oneof!["\\PC{0,4}".prop_map(|s| serde_json::to_string(&s).unwrap()), json_number()]), 0..4)
            .prop_map(|kv| {
                let items: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                format!("{{{}}}", items.join(","))
            }),
        1 => json_number(),
    ]
}

#[test]
fn json_headers_never_panic() {
    // Keys from a small set, so that duplicates, `__metadata__` and clashes come up often.
    let key = prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("__metadata__".to_string()),
        "\\PC{0,3}".prop_map(|s| s.replace(['"', '\\'], "")),
    ];
    let entry = (key, any::<bool>(), tensor_entry(), metadata_entry());
    let files = (vec(entry, 0..5), vec(any::<u8>(), 0..80), any::<bool>()).prop_map(
        |(entries, data, pad)| {
            let items: Vec<String> = entries
                .iter()
                .map(|(k, as_meta, t, m)| format!("\"{k}\":{}", if *as_meta { m } else { t }))
                .collect();
            let mut json = format!("{{{}}}", items.join(",")).into_bytes();
            while pad && json.len() % 8 != 0 {
                json.push(b' ');
            }
            prefixed(&json, &data)
        },
    );
    run("json", 1500, files, false);
}

/// A valid file: tensors of every dtype, data order and key order shuffled independently,
/// optional metadata anywhere among the keys, names with any printable characters.
fn valid_file() -> impl Strategy<Value = Vec<u8>> {
    let tensor = (0..DTYPES.len(), vec(0usize..5, 0..4), any::<u32>());
    (
        vec(tensor, 0..8),
        proptest::option::of(btree_map("[a-z_.]{1,5}", "\\PC{0,5}", 0..4)),
        any::<u32>(),
        "\\PC{0,4}",
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(tensors, metadata, meta_rank, prefix, pad, seed)| {
            let mut data = Vec::new();
            let mut keys: Vec<(u32, String)> = Vec::new();
            let mut x = seed | 1;
            for (i, (d, mut shape, rank)) in tensors.into_iter().enumerate() {
                let (dtype, bits) = DTYPES[d];
                if shape.iter().product::<usize>() * bits % 8 != 0 {
                    shape.push(8);
                }
                let n = shape.iter().product::<usize>() * bits / 8;
                let start = data.len();
                for _ in 0..n {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    data.push(x as u8);
                }
                let name = serde_json::to_string(&format!("{prefix}{i}")).unwrap();
                let entry = format!(
                    "{name}:{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{start},{}]}}",
                    data.len()
                );
                keys.push((rank, entry));
            }
            if let Some(meta) = metadata {
                let meta = serde_json::to_string(&meta).unwrap();
                keys.push((meta_rank, format!("\"__metadata__\":{meta}")));
            }
            keys.sort();
            let items: Vec<&str> = keys.iter().map(|(_, e)| e.as_str()).collect();
            let mut json = format!("{{{}}}", items.join(",")).into_bytes();
            while pad && json.len() % 8 != 0 {
                json.push(b' ');
            }
            prefixed(&json, &data)
        })
}

#[test]
fn valid_headers_round_trip() {
    run("valid", 1500, valid_file(), true);
}

#[test]
fn mutated_valid_files_never_panic() {
    let files = (
        valid_file(),
        vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        any::<prop::sample::Index>(),
        any::<bool>(),
    )
        .prop_map(|(mut file, flips, cut, truncate)| {
            for (at, byte) in flips {
                let i = at.index(file.len());
                file[i] = byte;
            }
            if truncate {
                file.truncate(cut.index(file.len() + 1));
            }
            file
        });
    run("mutated", 2000, files, false);
}
