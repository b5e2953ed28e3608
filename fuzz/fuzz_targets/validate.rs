//! Arbitrary bytes as a safetensors file: validate, plan both targets, convert in memory.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../check.rs"]
mod check;

fuzz_target!(|data: &[u8]| {
    check::check(data);
});
