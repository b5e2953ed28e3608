//! stcast: stream-convert checkpoints to bf16, fp16 or FP8, exactly, in bounded memory.
//!
//! The engine is plain Rust and knows neither Python nor the command line:
//! - `vocab`: every name that crosses the language boundary, defined once;
//! - `options`: every option of every command, defined once (name, kind, default, help);
//! - `given`: option values as the front ends give them, checked once; the exported names;
//! - `error`, `text`: typed errors and warnings, message templates;
//! - `source`, `header`: open an input and validate its safetensors header;
//! - `torch`: read PyTorch checkpoints (zip and legacy) without running their pickles;
//! - `input`: open any input (safetensors, or a PyTorch checkpoint) as one `Source`, the
//!   `Format` of every file kind and the sniffing that names it;
//! - `gather`: tensors read by gathering: strided views, and boxes in several files;
//! - `plan`, `dtype`: what each tensor becomes and where it goes;
//! - `kernels`, `numerics`: convert numbers, and measure what rounding did;
//! - `experts`: fused MoE experts split per expert under FP8 targets (as `model_free_ptq`);
//! - `fp8`: FP8 E4M3 quantization (as llm-compressor's `model_free_ptq`) and dequantization;
//! - `packed`: packed 4-/8-bit weights (NVFP4, MXFP4, INT4/INT8, gpt-oss blocks) back to bf16/fp16;
//! - `window`: the window cursor and parallel split every streaming pass uses;
//! - `convert`, `scan`, `verify`: the streaming passes;
//! - `naming`: output file names, stems and sizes (a leaf every other module may ask);
//! - `shard`: re-sharding: output shards of a bounded size, planned from the headers;
//! - `task`: those passes as steppable tasks with one progress count;
//! - `output`: every file stcast writes appears atomically, only when complete;
//! - `run`: folder runs: the JSON texts they write (configs, indexes);
//! - `report`: the numeric report file;
//! - `record`: the options convert records in each output's `__metadata__` for `verify`;
//! - `run`: what a folder run decides about its files (the source folder's walk);
//! - `command`: one entry per command (`convert`, `inspect`, `verify`), routed once to one
//!   file or a folder run;
//! - `folder`: a folder run's plan, whole: walk, indexes, configs, each file's inspection;
//!   and its verify (`folder::verify_folder`);
//! - `env`, `failpoint`: the one reader of the environment, and the test hooks it arms.
//!
//! `python` (feature `python`) is the only module that knows about PyO3.

pub mod command;
pub mod convert;
pub mod dtype;
pub mod env;
pub mod error;
pub mod experts;
pub mod failpoint;
pub mod folder;
pub mod format;
pub mod fp8;
pub mod fused;
pub mod gather;
pub mod given;
pub mod header;
pub mod input;
pub mod kernels;
pub mod naming;
pub mod numerics;
pub mod options;
pub mod output;
pub mod packed;
pub mod pattern;
pub mod plan;
#[cfg(feature = "python")]
mod python;
pub mod quant;
pub mod record;
pub mod report;
pub mod run;
pub mod scan;
pub mod shard;
pub mod source;
pub mod task;
#[cfg(test)]
mod testutil;
pub mod text;
pub mod torch;
pub mod verify;
pub mod vocab;
pub mod window;

pub use convert::{Job, Options, Report, Tuning};
pub use dtype::{Action, Conversion};
pub use error::{Error, Result, Warning};
pub use input::InputOptions;
pub use kernels::Isa;
pub use numerics::Numerics;
pub use plan::{Plan, PlanOptions, Reason};
pub use source::Source;
pub use task::{convert, ConvertTask, InspectTask, Task};
pub use verify::{verify, Mismatch, Verifier, VerifyOptions, VerifyReport};
pub use vocab::{ErrorKind, OnOverflow, ReadAdvice, Target, Unmatched, WarningKind};

/// The crate version, which is also the Python package's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
