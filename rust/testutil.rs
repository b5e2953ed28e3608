//! Helpers shared by the unit tests.

use std::path::{Path, PathBuf};

use crate::options::Given;

/// A safetensors file from its JSON header and `data_len` zero bytes of data.
pub(crate) fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.resize(v.len() + data_len, 0);
    v
}

/// A path for messages.
pub(crate) fn p() -> &'static Path {
    Path::new("x.safetensors")
}

/// A fresh folder `stcast-{tag}-{pid}` in the temp folder holding `files`, each holding
/// its own name (a name ending in `/` makes a folder).
pub(crate) fn folder(tag: &str, files: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stcast-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in files {
        let p = dir.join(f);
        if f.ends_with('/') {
            std::fs::create_dir_all(&p).unwrap();
        } else {
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, f.as_bytes()).unwrap();
        }
    }
    dir
}

/// A fresh folder `stcast-{tag}-{pid}` holding `files` (relative path, bytes).
pub(crate) fn folder_of(tag: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    let dir = folder(tag, &[]);
    for (rel, bytes) in files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
    dir
}

/// A safetensors file of `side`x`side` F32 tensors (zeros) named `names`.
pub(crate) fn f32s(names: &[&str], side: usize) -> Vec<u8> {
    let n = side * side * 4;
    let entries: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let (a, b) = (i * n, i * n + n);
            format!(
                r#""{name}":{{"dtype":"F32","shape":[{side},{side}],"data_offsets":[{a},{b}]}}"#
            )
        })
        .collect();
    file(&format!("{{{}}}", entries.join(",")), names.len() * n)
}

/// xorshift64*: deterministic, seeded, good enough to scatter test inputs.
pub(crate) struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Runs `f` on this thread with the MXCSR flush-to-zero and denormals-are-zero bits set (as
/// a library built with -ffast-math may leave them in a Python process), then restores
/// MXCSR. Also checks that the modes were in force: a subnormal product was flushed.
#[cfg(target_arch = "x86_64")]
pub(crate) fn with_ftz_daz<R>(f: impl FnOnce() -> R) -> R {
    use std::arch::asm;
    fn read_mxcsr() -> u32 {
        let mut csr = 0u32;
        // SAFETY: stmxcsr stores 4 bytes into the local it is given.
        unsafe { asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack)) };
        csr
    }
    fn write_mxcsr(csr: u32) {
        // SAFETY: ldmxcsr reads 4 bytes from the local it is given; the value only changes
        // rounding/flush behaviour of this thread, restored by the caller.
        unsafe { asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack)) };
    }
    const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
    let saved = read_mxcsr();
    write_mxcsr(saved | FTZ_DAZ);
    let flushed = std::hint::black_box(f32::MIN_POSITIVE) * std::hint::black_box(0.5);
    let r = f();
    write_mxcsr(saved);
    assert_eq!(flushed, 0.0, "FTZ was not in force");
    r
}

/// An option's value given as text (`to="bf16"`), as a front end hands it over.
pub(crate) fn text(t: &str) -> Given {
    Given {
        text: Some(t.into()),
        whole: None,
        repr: format!("'{t}'"),
    }
}

/// An option's value given as a whole number.
pub(crate) fn whole(n: u64) -> Given {
    Given {
        text: None,
        whole: Some(n),
        repr: n.to_string(),
    }
}

/// The index of `sharded_hf`'s two shards.
pub(crate) const SHARDED_INDEX: &str = r#"{"metadata": {"total_size": 256}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors", "d": "model-00002-of-00002.safetensors"}}"#;

/// A fresh sharded HF checkpoint `stcast-{tag}-{pid}`: two shards of two 4x4 F32 tensors,
/// their index, a config, and `extra` files.
pub(crate) fn sharded_hf(tag: &str, extra: &[(&str, Vec<u8>)]) -> PathBuf {
    let mut files = vec![
        ("model-00001-of-00002.safetensors", f32s(&["a", "b"], 4)),
        ("model-00002-of-00002.safetensors", f32s(&["c", "d"], 4)),
        ("model.safetensors.index.json", SHARDED_INDEX.into()),
        ("config.json", br#"{"torch_dtype": "float32"}"#.to_vec()),
    ];
    files.extend(extra.iter().cloned());
    folder_of(tag, &files)
}

/// A fresh copy `stcast-{tag}-{pid}` of the committed fixture `tests/fixtures/{fixture}`:
/// only `files`, a name ending in `/` a whole folder (its files).
pub(crate) fn fixture(tag: &str, fixture: &str, files: &[&str]) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let dir = folder(tag, &[]);
    for f in files {
        let (from, to) = (from.join(f), dir.join(f));
        if f.ends_with('/') {
            std::fs::create_dir_all(&to).unwrap();
            for e in std::fs::read_dir(&from).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        } else {
            std::fs::copy(from, to).unwrap();
        }
    }
    dir
}
