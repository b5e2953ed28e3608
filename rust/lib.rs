//! stcast: stream-convert safetensors checkpoints to bf16 (or fp16), exactly, in bounded memory.
//!
//! The engine is plain Rust: `header` validates and plans, `kernels` converts numbers,
//! `convert` streams a file through both, `output` makes the result appear atomically.
//! `python` (feature `python`) is the only place that knows about PyO3.

pub mod convert;
pub mod error;
pub mod failpoint;
pub mod fused;
pub mod header;
pub mod kernels;
pub mod numerics;
pub mod output;
#[cfg(feature = "python")]
mod python;
pub mod scan;
#[cfg(test)]
mod testutil;
pub mod verify;

pub use convert::{convert, inspect, Job, Options, ReadAdvice, Report, Source};
pub use error::{Error, Result};
pub use header::{Action, Conversion, Plan, PlanOptions, Reason, SourceHeader, Target, Unmatched};
pub use kernels::Isa;
pub use numerics::Numerics;
pub use scan::{OnOverflow, Scan, ScanKind};
pub use verify::{verify, Mismatch, Verifier, VerifyOptions, VerifyReport};

/// The crate version, which is also the Python package's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
