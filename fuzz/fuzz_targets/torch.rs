//! Arbitrary bytes as a PyTorch checkpoint: sniff, read, select and gather every tensor.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stcast::torch;

#[path = "../torch_check.rs"]
mod check;

fuzz_target!(|data: &[u8]| {
    check::check(data);
});
