//! The engine's folder runs: what a run decides about the files of a checkpoint folder.
//! - `json`: every JSON text a run writes or edits (configs, indexes, `quantization_config`).

pub mod json;
