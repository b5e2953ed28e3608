//! What kind of file an input is: the one enum of every format stcast recognises (those
//! it reads, and those it names in a refusal: GGUF, an HTML page, a Git LFS pointer...).
//!
//! A leaf: the sniffing that tells them apart is `torch::sniff`, which reads zip
//! directories; keeping the enum apart lets every reader name a format without a cycle.

/// What a file looks like, from its first bytes (and, for zips, its entry names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// 8-byte header length, then a JSON object.
    Safetensors,
    /// A zip archive with a `data.pkl`: `torch.save` since torch 1.6.
    TorchZip,
    /// A TorchScript archive (`torch.jit.save`): a zip with `constants.pkl` and `code/`.
    TorchScript,
    /// A pickled torch magic number: `torch.save` before 1.6 or with the legacy option.
    TorchLegacy,
    /// Some other pickle.
    Pickle,
    /// `GGUF` magic (llama.cpp).
    Gguf,
    /// A zip archive of `.npy` files (`numpy.savez`).
    Npz,
    /// `\x93NUMPY` magic.
    Npy,
    /// Some other zip archive.
    Zip,
    /// An HTML page (often a failed download).
    Html,
    /// A Git LFS pointer: a clone without `git lfs pull`.
    LfsPointer,
    /// An empty file (0 bytes).
    Empty,
    /// gzip-compressed data.
    Gzip,
    /// HDF5 (Keras `.h5`).
    Hdf5,
    /// Text that is a JSON object or array (a config or an index given for a weight file).
    Json,
    /// Other text (a README, a model card...).
    Text,
    /// A `torch.distributed.checkpoint` folder: `.metadata` and `__{rank}_{n}.distcp` files
    /// (FSDP, torchtitan, Megatron `torch_dist`). A folder, told apart by `input::folder`.
    Dcp,
    /// A folder of safetensors shards that DCP's `HuggingFaceStorageWriter` wrote in a
    /// distributed save: each rank's chunks, placed by `__metadata__["DCP_SHARDING_INFO"]`.
    DcpSafetensors,
    /// A DeepSpeed checkpoint folder: `latest` and the tag folder's ZeRO partitions.
    DeepSpeed,
    Unknown,
}

impl Format {
    /// The format with an article, for messages ("this is a GGUF file (llama.cpp), not ...").
    pub fn describe(&self) -> &'static str {
        match self {
            Format::Safetensors => "a safetensors file",
            Format::TorchZip => "a PyTorch checkpoint (torch.save zip)",
            Format::TorchLegacy => "a legacy PyTorch checkpoint (torch.save pickle)",
            Format::Pickle => "a Python pickle without torch's header",
            Format::Gguf => "a GGUF file (llama.cpp)",
            Format::Npz => "a NumPy .npz archive",
            Format::Npy => "a NumPy .npy file",
            Format::TorchScript => {
                "a TorchScript archive (torch.jit.save: get a state dict with \
                 `torch.save(torch.jit.load(path).state_dict(), 'model.pt')`)"
            }
            Format::Zip => "a zip archive without data.pkl",
            Format::Html => "an HTML page (a failed download?)",
            Format::LfsPointer => "a Git LFS pointer, not the file itself (run `git lfs pull`)",
            Format::Empty => "an empty file (0 bytes)",
            Format::Gzip => "gzip-compressed data (decompress it first)",
            Format::Hdf5 => "an HDF5 file (Keras .h5)",
            Format::Json => "a JSON text file (a config or an index?)",
            Format::Text => "a text file",
            Format::Dcp => "a torch.distributed.checkpoint (DCP) folder",
            Format::DcpSafetensors => {
                "a torch.distributed.checkpoint folder of safetensors shards \
                 (HuggingFaceStorageWriter)"
            }
            Format::DeepSpeed => "a DeepSpeed checkpoint folder (ZeRO partitions)",
            Format::Unknown => "a file of unknown format",
        }
    }
}
