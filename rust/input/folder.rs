//! What kind of checkpoint a folder holds. A Hugging Face folder (safetensors or
//! `pytorch_model*.bin` shards, an index, configs) is converted file by file by the folder
//! code; a training checkpoint written by a distributed run is not a set of files to convert
//! one by one: `torch.distributed.checkpoint` (DCP: `.metadata` beside `__{rank}_{n}.distcp`
//! files) and DeepSpeed (`latest` naming a tag folder of `*_model_states.pt` and
//! `*_optim_states.pt` partitions). This is where such a folder is told apart, before
//! anything reads it as a Hugging Face folder; an opener for it goes beside this module.
//!
//! The listing is bounded: at most `MAX_ENTRIES` names are looked at, and none is read.

use std::path::Path;

use crate::error::{Error, Result};

use crate::format::Format;

/// Entries of a folder looked at to tell its kind (a DCP folder of 10,000 ranks lists
/// 10,001 names; past this many, the names seen decide).
const MAX_ENTRIES: usize = 100_000;

/// The checkpoint format of folder `dir` when it is a distributed training checkpoint
/// (`Format::Dcp`, `Format::DeepSpeed`); `None` for any other folder (a Hugging Face one, as
/// far as this can tell).
pub fn folder_format(dir: &Path) -> Option<Format> {
    let listed = names(dir);
    let has = |n: &str| listed.iter().any(|x| x == n);
    // `.metadata` beside the ranks' `.distcp` files is a DCP checkpoint, whatever else was
    // put beside it (a consolidated `model.safetensors`).
    // Either without the other is an incomplete one (`dcp.save` writes `.metadata` last),
    // refused as such when read.
    if has(".metadata") || listed.iter().any(|n| n.ends_with(".distcp")) {
        let distcp = listed.iter().any(|n| n.ends_with(".distcp"));
        if distcp || !listed.iter().any(|n| is_weights(n)) {
            return Some(Format::Dcp);
        }
    }
    // Safetensors shards that DCP's HuggingFaceStorageWriter wrote, each a rank's chunks:
    // told by the first one's `__metadata__` (read within its header's size).
    // The first file, and any named as that writer names them (`shard-00001-model-...`):
    // a folder of its shards with another file beside it is still one (and is refused,
    // naming that file, when read).
    let shards = sharded_safetensors(&listed);
    let named = shards.iter().filter(|n| n.starts_with("shard-")).take(64);
    if shards
        .first()
        .into_iter()
        .chain(named)
        .any(|n| is_dcp_shard(&dir.join(n)))
    {
        return Some(Format::DcpSafetensors);
    }
    // Weights stcast converts make it a Hugging Face folder, whatever else it holds: the
    // Trainer saves `checkpoint-N/` with `model.safetensors` beside DeepSpeed's `latest`
    // and `global_stepN/`.
    if listed.iter().any(|n| is_weights(n)) {
        return None;
    }
    if listed
        .iter()
        .any(|n| is_model_states(n) || is_optim_states(n))
    {
        return Some(Format::DeepSpeed);
    }
    // Tag folders of partitions (`global_step100/`) make a DeepSpeed checkpoint even when
    // `latest`, which names the one to read, is missing or names another (read, it is
    // refused saying so). `latest` alone does not: any folder may hold a file of that name
    // (a diffusers pipeline's, beside `model_index.json` and its weights' folders).
    if !zero_tags(dir).is_empty() {
        return Some(Format::DeepSpeed);
    }
    None
}

/// The tag `dir/latest` names: one folder name (its whitespace trimmed).
pub fn latest_tag(dir: &Path) -> Option<String> {
    let tag = read_latest(&dir.join("latest"))?;
    Some(tag.trim().to_string()).filter(|t| is_one_name(t))
}

/// DeepSpeed's `latest` file at `path` as text: read only when it is a regular file of at
/// most 4096 bytes (opened without blocking, so a FIFO never hangs, and never read past
/// that bound, so a huge file saved there by mistake costs nothing).
pub fn read_latest(path: &Path) -> Option<String> {
    use std::io::Read;
    const MAX: u64 = 4096;
    let (file, meta) = crate::source::open_regular(path).ok()?;
    if meta.len() > MAX {
        return None;
    }
    let mut text = Vec::new();
    file.take(MAX + 1).read_to_end(&mut text).ok()?;
    if text.len() as u64 > MAX {
        return None;
    }
    String::from_utf8(text).ok()
}

/// Refuse a symlink among the entries of the checkpoint folder `dir` (and of the tag folder
/// its `latest` names, for DeepSpeed) that leads outside `dir`, unless `follow`: the one
/// link policy of every input kind, as a Hugging Face folder's walk applies it. A link is
/// followed when it resolves inside `dir` (by identity: the real folder's chain of parents
/// holds `dir`), or, for a file, into the `blobs/` of a Hugging Face cache repo, where
/// cache snapshots link. A broken link is left to the reader, which names it if it reads it.
pub fn check_links(dir: &Path, format: Format, follow: bool) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(root) = std::fs::metadata(dir) else {
        return Ok(());
    };
    if follow {
        return Ok(());
    }
    let root = (root.dev(), root.ino());
    let mut folders = vec![dir.to_path_buf()];
    if format == Format::DeepSpeed {
        folders.extend(latest_tag(dir).map(|tag| dir.join(tag)));
    }
    for folder in &folders {
        let Ok(entries) = std::fs::read_dir(folder) else {
            continue;
        };
        for e in entries.take(MAX_ENTRIES).flatten() {
            if !e.file_type().is_ok_and(|t| t.is_symlink()) {
                continue;
            }
            let link = e.path();
            let (Ok(target), Ok(meta)) = (std::fs::canonicalize(&link), std::fs::metadata(&link))
            else {
                continue;
            };
            let is_dir = meta.is_dir();
            if !link_stays(&target, is_dir, root) {
                return Err(Error::LinkOutside {
                    link,
                    target,
                    folder: is_dir,
                });
            }
        }
    }
    Ok(())
}

/// Does a symlink whose resolved target is `target` (a folder if `is_dir`) stay within what
/// was asked for: inside the folder `root` (by identity: the real folder's chain of parents
/// holds it), or, for a file, in the `blobs/` of a Hugging Face cache repo? The one link
/// policy of every input kind (`check_links`, and a Hugging Face folder's walk).
pub fn link_stays(target: &Path, is_dir: bool, root: (u64, u64)) -> bool {
    let home = if is_dir {
        target.to_path_buf()
    } else {
        crate::output::parent_dir(target)
    };
    crate::output::folder_chain(&home).contains(&root) || (!is_dir && is_hub_blob(target))
}

/// Is `target` (resolved) a file in the `blobs/` folder of a Hugging Face cache repo
/// (`.../models--org--name/blobs/<hash>`)?
fn is_hub_blob(target: &Path) -> bool {
    let blobs = target.parent();
    let repo = blobs.and_then(Path::parent);
    let name = |p: Option<&Path>| {
        p.and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    name(blobs) == "blobs"
        && ["models--", "datasets--", "spaces--"]
            .iter()
            .any(|k| name(repo).starts_with(k))
}

/// The folders of `dir` (the first 64 of them, sorted) that hold DeepSpeed model or
/// optimizer states: its tag folders.
pub fn zero_tags(dir: &Path) -> Vec<String> {
    let mut tags: Vec<String> = names(dir)
        .into_iter()
        .filter(|n| is_one_name(n) && dir.join(n).is_dir())
        .take(64)
        .filter(|n| is_zero_tag(&dir.join(n)))
        .collect();
    tags.sort();
    tags
}

/// Is folder `dir` a DeepSpeed tag folder: does it hold model or optimizer states
/// (`*_model_states.pt`, `*_optim_states.pt`)? What `latest` names is training state only
/// then: any folder may be named by a file of that name (`latest` -> `ema/`, weights).
pub fn is_zero_tag(dir: &Path) -> bool {
    names(dir)
        .iter()
        .any(|f| is_model_states(f) || is_optim_states(f))
}

/// Is folder `dir` one checkpoint, read as one source (a DCP or DeepSpeed ZeRO folder:
/// `true`), or a folder of files (`false`)? A distributed checkpoint stcast cannot read is
/// refused, naming what it is; as an `output` (a DST to verify), any is.
pub fn check_folder(dir: &Path, output: bool) -> Result<bool> {
    match folder_format(dir) {
        Some(format) if output => Err(Error::NotAnOutput {
            path: dir.to_path_buf(),
            format,
        }),
        Some(Format::Dcp | Format::DcpSafetensors | Format::DeepSpeed) => Ok(true),
        Some(format) => Err(Error::OtherFormat {
            path: dir.to_path_buf(),
            format,
        }),
        None => Ok(false),
    }
}

/// `_N` or nothing: the numbers trainers put after a state file's name.
fn numbered(rest: &[u8]) -> bool {
    rest.is_empty() || rest.strip_prefix(b"_").is_some_and(digits)
}

/// A non-empty run of ASCII digits.
pub fn digits(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(u8::is_ascii_digit)
}

/// A training run's state beside its weights, by the names transformers' Trainer,
/// accelerate, DeepSpeed and Lightning give it: optimizer, scheduler, scaler and RNG states,
/// training arguments, DeepSpeed's recovery scripts. Not weights, never read (its pickles
/// name optimizers and RNG states), never copied into a weights folder.
pub fn is_trainer_state(name: &[u8]) -> bool {
    let state = |prefix: &[u8], exts: &[&[u8]]| {
        exts.iter().any(|ext| {
            name.strip_prefix(prefix)
                .and_then(|r| r.strip_suffix(*ext))
                .is_some_and(numbered)
        })
    };
    state(b"optimizer", &[b".bin", b".pt"])
        || state(b"scheduler", &[b".bin", b".pt"])
        || state(b"scaler", &[b".bin", b".pt"])
        || state(b"rng_state", &[b".pth"])
        || name
            .strip_prefix(b"random_states_")
            .and_then(|r| r.strip_suffix(b".pkl"))
            .is_some_and(digits)
        // accelerate's FSDP weights saved per rank (`LOCAL_STATE_DICT`): flat parameters.
        || name
            .strip_prefix(b"pytorch_model_fsdp_")
            .and_then(|r| r.strip_suffix(b".bin"))
            .is_some_and(digits)
        || [
            &b"training_args.bin"[..],
            b"trainer_state.json",
            b"zero_to_fp32.py",
            b"zero_to_torch.py",
        ]
        .contains(&name)
}

/// `mp_rank_00_model_states.pt` (ZeRO-1/2), `zero_pp_rank_0_mp_rank_00_model_states.pt`
/// (ZeRO-3): DeepSpeed's model states, one per model-parallel rank.
fn is_model_states(name: &str) -> bool {
    name.ends_with("_model_states.pt")
        && (name.starts_with("mp_rank_") || name.starts_with("zero_pp_rank_"))
}

/// `zero_pp_rank_0_mp_rank_00_optim_states.pt` (`bf16_` before it in bf16 runs): a rank's
/// ZeRO partition of the optimizer states.
fn is_optim_states(name: &str) -> bool {
    name.ends_with("_optim_states.pt") && name.contains("zero_pp_rank_")
}

/// A weight file of a Hugging Face folder: `*.safetensors`, `pytorch_model*.bin`.
fn is_weights(name: &str) -> bool {
    name.ends_with(".safetensors") || (name.starts_with("pytorch_model") && name.ends_with(".bin"))
}

/// A single folder name: no separator, not `.` or `..`.
fn is_one_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\0'])
}

/// The `*.safetensors` names among `listed`, sorted.
fn sharded_safetensors(listed: &[String]) -> Vec<String> {
    let mut out: Vec<String> = listed
        .iter()
        .filter(|n| n.ends_with(".safetensors"))
        .cloned()
        .collect();
    out.sort();
    out
}

/// The `*.safetensors` files of `dir`, sorted: the shards of a `DcpSafetensors` folder.
pub fn dcp_shards(dir: &Path) -> Vec<String> {
    sharded_safetensors(&names(dir))
}

/// Is `path` a safetensors shard of DCP's HuggingFaceStorageWriter (its `__metadata__`
/// has `DCP_SHARDING_INFO`)? Unreadable or invalid: no.
fn is_dcp_shard(path: &Path) -> bool {
    crate::source::Source::open(path).is_ok_and(|s| {
        s.header
            .metadata
            .is_some_and(|m| m.iter().any(|(k, _)| k == super::dcp::SHARDING_INFO))
    })
}

/// The files beside the checkpoint in the checkpoint folder `dir` of `format` (a DCP or
/// ZeRO folder), sorted, with their sizes: its regular files (links followed) that are
/// neither the checkpoint's own (`.metadata`, rank files, shards; `latest`) nor training
/// state (`is_trainer_state`) nor stcast's bookkeeping. A model's `config.json` and
/// tokenizer, say: the checkpoint converts to one file, and they are named as left out.
pub fn companions(dir: &Path, format: Format) -> Vec<(String, u64)> {
    let own = |n: &str| match format {
        Format::Dcp => n == ".metadata" || n.ends_with(".distcp"),
        Format::DcpSafetensors => n.ends_with(".safetensors"),
        Format::DeepSpeed => n == "latest" || is_model_states(n) || is_optim_states(n),
        _ => false,
    };
    let mut out: Vec<(String, u64)> = names(dir)
        .into_iter()
        .filter(|n| !own(n) && !is_trainer_state(n.as_bytes()) && !n.starts_with(".stcast-"))
        .filter_map(|n| {
            let meta = std::fs::metadata(dir.join(&n)).ok()?;
            meta.is_file().then_some((n, meta.len()))
        })
        .collect();
    out.sort();
    out
}

/// Up to `MAX_ENTRIES` names of `dir` (none if it cannot be listed).
fn names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .take(MAX_ENTRIES)
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(tag: &str, files: &[&str]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("stcast-folder-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for f in files {
            let p = dir.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, if *f == "latest" { "global_step7\n" } else { "" }).unwrap();
        }
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn distributed_checkpoints_are_told_apart_from_hugging_face_folders() {
        let cases: &[(&str, &[&str], Option<Format>)] = &[
            (
                "dcp",
                &[".metadata", "__0_0.distcp", "__1_0.distcp"],
                Some(Format::Dcp),
            ),
            ("meta-only", &[".metadata", "model.safetensors"], None),
            (
                "zero2",
                &[
                    "mp_rank_00_model_states.pt",
                    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                ],
                Some(Format::DeepSpeed),
            ),
            (
                "zero3",
                &["zero_pp_rank_1_mp_rank_00_model_states.pt"],
                Some(Format::DeepSpeed),
            ),
            (
                "latest",
                &[
                    "latest",
                    "global_step7/mp_rank_00_model_states.pt",
                    "zero_to_fp32.py",
                ],
                Some(Format::DeepSpeed),
            ),
            (
                "optim-only",
                &["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                Some(Format::DeepSpeed),
            ),
            // A folder of DeepSpeed partitions whose `latest` names no tag folder of them is
            // DeepSpeed still: read, it is refused naming `latest` and the tags found.
            (
                "latest-elsewhere",
                &["latest", "other/mp_rank_00_model_states.pt"],
                Some(Format::DeepSpeed),
            ),
            ("hf", &["model.safetensors", "config.json"], None),
            // `latest` alone (naming a tag, or a tag folder without partitions) is a file
            // of any folder: a diffusers pipeline's weights are in its subfolders.
            (
                "diffusers-latest",
                &[
                    "model_index.json",
                    "latest",
                    "unet/diffusion_pytorch_model.safetensors",
                    "unet/config.json",
                ],
                None,
            ),
            ("latest-alone", &["latest", "global_step7/notes.txt"], None),
            // The Trainer's checkpoint-N/ under DeepSpeed: the weights are there already.
            (
                "trainer",
                &[
                    "model.safetensors",
                    "latest",
                    "global_step7/mp_rank_00_model_states.pt",
                ],
                None,
            ),
            (
                "trainer-bin",
                &["pytorch_model.bin", "mp_rank_00_model_states.pt"],
                None,
            ),
            (
                "dcp-beside-weights",
                &[
                    ".metadata",
                    "__0_0.distcp",
                    "model-00001-of-00002.safetensors",
                ],
                Some(Format::Dcp),
            ),
            ("empty", &[], None),
        ];
        for (tag, files, want) in cases {
            let dir = folder(tag, files);
            assert_eq!(folder_format(&dir), *want, "{tag}");
            // DCP and DeepSpeed folders are read as one checkpoint.
            assert_eq!(check_folder(&dir, false).unwrap(), want.is_some(), "{tag}");
            assert_eq!(check_folder(&dir, true).is_err(), want.is_some(), "{tag}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn links_out_of_a_checkpoint_are_refused_unless_followed() {
        use std::os::unix::fs::symlink;
        let dir = folder(
            "links",
            &["latest", "global_step7/mp_rank_00_model_states.pt"],
        );
        let away = dir.with_extension("away");
        let _ = std::fs::remove_dir_all(&away);
        std::fs::create_dir_all(&away).unwrap();
        std::fs::write(away.join("rank.pt"), "").unwrap();
        // Inside: followed.
        symlink("global_step7", dir.join("alias")).unwrap();
        symlink("mp_rank_00_model_states.pt", dir.join("global_step7/l.pt")).unwrap();
        check_links(&dir, Format::DeepSpeed, false).unwrap();
        // A file of the tag folder that leads out: named, whatever the folder's kind.
        symlink(away.join("rank.pt"), dir.join("global_step7/out.pt")).unwrap();
        let e = check_links(&dir, Format::DeepSpeed, false).unwrap_err();
        let Error::LinkOutside { link, folder, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!((link, *folder), (&dir.join("global_step7/out.pt"), false));
        assert!(e.message().contains("{follow_links}"), "{}", e.message());
        check_links(&dir, Format::DeepSpeed, true).unwrap();
        std::fs::remove_file(dir.join("global_step7/out.pt")).unwrap();
        // The tag folder itself.
        std::fs::rename(dir.join("global_step7"), away.join("tag")).unwrap();
        symlink(away.join("tag"), dir.join("global_step7")).unwrap();
        let e = check_links(&dir, Format::DeepSpeed, false).unwrap_err();
        assert!(
            matches!(e, Error::LinkOutside { folder: true, .. }),
            "{e:?}"
        );
        // A cache snapshot's links into its repo's blobs/ are followed.
        let repo = away.join("models--org--name");
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots/abc")).unwrap();
        std::fs::write(repo.join("blobs/0123"), "").unwrap();
        symlink("../../blobs/0123", repo.join("snapshots/abc/.metadata")).unwrap();
        check_links(&repo.join("snapshots/abc"), Format::Dcp, false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&away).unwrap();
    }

    #[test]
    fn a_latest_that_escapes_its_folder_is_not_followed() {
        let dir = folder("escape", &["latest"]);
        std::fs::write(dir.join("latest"), "../elsewhere").unwrap();
        assert_eq!(folder_format(&dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
