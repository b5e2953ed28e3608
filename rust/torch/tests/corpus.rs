//! The fuzz target's property (`fuzz/torch_check.rs`) run as a plain test: over the fixtures
//! and over deterministic mutations of them (bit flips, byte sets, truncations, splices).

use crate::torch;

#[path = "../../../fuzz/torch_check.rs"]
mod check;

/// xorshift64*: a fixed, dependency-free sequence.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/torch");
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let n = b.len();
        match rng.below(6) {
            0 if n > 0 => {
                let i = rng.below(n);
                b[i] ^= 1 << rng.below(8);
            }
            1 if n > 0 => {
                let i = rng.below(n);
                b[i] = [0, 0xff, 0x7f, 0x80, b'(', b'R'][rng.below(6)];
            }
            2 => b.truncate(rng.below(n + 1)),
            3 if n > 8 => {
                // Overwrite 8 bytes with a little-endian number (sizes and offsets).
                let i = rng.below(n - 8);
                let v = [0u64, 1, 0xffff_ffff, u64::MAX, 1 << 32, rng.next()][rng.below(6)];
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            4 if !other.is_empty() => {
                let (i, j) = (rng.below(n + 1), rng.below(other.len()));
                let k = rng.below(other.len() - j).min(256);
                b.splice(i..i, other[j..j + k].iter().copied());
            }
            _ if n > 1 => {
                let i = rng.below(n);
                let k = rng.below(n - i).min(64);
                b.drain(i..i + k);
            }
            _ => {}
        }
    }
    b
}

#[test]
fn fixtures_pass_the_fuzz_property() {
    let seeds = seeds();
    assert!(seeds.len() >= 10);
    let evil = seeds.iter().filter(|s| check::check(s) == 0).count();
    assert_eq!(evil, 1, "only evil.pt selects nothing");
}

#[test]
fn mutated_fixtures_never_panic() {
    let seeds = seeds();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut accepted, runs) = (0, 4000);
    for r in 0..runs {
        let s = &seeds[r % seeds.len()];
        let o = &seeds[rng.below(seeds.len())];
        let input = mutate(&mut rng, s, o);
        if check::check(&input) > 0 {
            accepted += 1;
        }
    }
    // Mutations that miss the data still load: the property ran on real selections.
    assert!(accepted > runs / 20, "only {accepted} of {runs} loaded");
}
