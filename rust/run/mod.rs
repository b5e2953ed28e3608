//! A run over a folder: what the engine decides about a checkpoint's files before and while
//! it converts them.
//!
//! - `walk`: a source folder's files, classified and checked (links, trainer state,
//!   superseded PyTorch files, incomplete shard sets); a destination's listing.
//! - `place`: where a run reads and writes: the source (a Hugging Face cache repo's snapshot),
//!   the default destination, the destination's place against the source, by identity.
//! - `json`: every JSON text a run writes or edits (configs, indexes, `quantization_config`).
//! - `manifest`: what a run has planned and written into its destination (`--resume`,
//!   `--shard i/N`, `finalize`), and which files there stcast wrote.
//! - `publish`: how a run writes into its destination: each file claimed, published and
//!   recorded, only what it may replace replaced; old indexes and configs withdrawn first, a
//!   failed run rolled back, stale shards and the manifests removed at the end.
//! - `survey`: what a run writes into its destination and whether it may: which files
//!   there are stcast's, adopted or done (`--resume`), foreign or leftovers, and the room.
//! - `beside`: the configs, shards and index beside a lone output (a file, or a DCP, ZeRO
//!   or single-file source written into a folder), and the configs a folder run leaves, as
//!   they must describe the weights beside them.
//! - `check`: what verify finds in a destination's files beside its weights (copies,
//!   configs, indexes, an index left beside the output, configs added to an FP8 output).
//! - `fp8config`: what an FP8 output's `quantization_config` must say of the tensors beside
//!   it, as verify judges one another tool wrote.

pub mod beside;
pub mod check;
pub mod fp8config;
pub mod json;
pub mod manifest;
pub mod place;
pub mod publish;
pub mod survey;
pub mod walk;
