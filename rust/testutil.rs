//! Helpers shared by the unit tests.

use std::path::{Path, PathBuf};

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
