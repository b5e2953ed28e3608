//! The legacy `torch.save` format (torch < 1.6, or `_use_new_zipfile_serialization=False`):
//! five pickles in a row (magic number, protocol version, sys_info, the object, the storage
//! keys), then for each key in that order an 8-byte element count and the storage's bytes.
//!
//! Storage offsets are found by a bounded sequential scan of the counts, each checked against
//! the count the pickle recorded; no storage byte is read. Storages are not aligned.
//!
//! Byte order: torch has always written legacy storage *data* little-endian (its writer
//! converts on big-endian machines, and its reader ignores `sys_info`), so these storages are
//! little-endian whatever `sys_info["little_endian"]` says. Only the element counts were
//! written in the machine's order by old versions: a count that matches the pickle only when
//! read big-endian is accepted when `sys_info` says big-endian.

use std::collections::HashMap;

use super::error::TorchError;
use super::pickle::{self, NoStorages, ObjId, Object, Objects, Pickle, StorageRef, Storages};
use super::{parse_pid, pid_error, reference, Limits, Storage};

pub use super::sniff::LEGACY_MAGIC as MAGIC;
/// The legacy protocol version torch writes.
pub const PROTOCOL_VERSION: i64 = 1001;

struct LegacyStorages {
    storages: Vec<Storage>,
    by_key: HashMap<String, usize>,
    /// Views by view key: torch caches a view under its key, so every later reference with
    /// that key gets the first one's range and dtype.
    views: HashMap<String, StorageRef>,
}

impl Storages for LegacyStorages {
    fn load(&mut self, objects: Objects<'_, '_>, pid: ObjId) -> Result<StorageRef, TorchError> {
        let pid = parse_pid(objects, pid)?;
        let es = u64::from(pid.dtype.size);
        if self.views.contains_key(pid.key) {
            return Err(pid_error(format!(
                "storage key `{}` names an earlier view",
                pid.key
            )));
        }
        let index = match self.by_key.get(pid.key) {
            Some(&i) => i,
            None => {
                let len = pid
                    .numel
                    .checked_mul(es)
                    .ok_or(TorchError::StorageTooShort {
                        key: pid.key.to_string(),
                        need: u64::MAX,
                        have: 0,
                    })?;
                self.storages.push(Storage {
                    key: super::StorageKey::new(pid.key),
                    dtype: pid.dtype,
                    elem_size: es,
                    numel: pid.numel,
                    offset: 0,
                    len,
                    big_endian: false,
                    in_zip: false,
                });
                self.by_key
                    .insert(pid.key.to_string(), self.storages.len() - 1);
                self.storages.len() - 1
            }
        };
        let root = &self.storages[index];
        let whole = reference(index, root.dtype, root.len, &pid, false);
        let Some((view_key, off, size)) = pid.view else {
            return Ok(whole);
        };
        if self.by_key.contains_key(view_key) {
            return Err(pid_error(format!("view key `{view_key}` names a storage")));
        }
        if let Some(&cached) = self.views.get(view_key) {
            return Ok(cached);
        }
        // As torch: the view's offset and size count elements of this reference's dtype.
        let end = off.checked_add(size).and_then(|e| e.checked_mul(es));
        let view = match end {
            _ if whole.conflict.is_some() => whole,
            Some(end) if end <= root.len => StorageRef {
                offset: off * es,
                len: Some(size * es),
                ..whole
            },
            _ => {
                return Err(TorchError::StorageView {
                    key: root.key.to_string(),
                    end: end.unwrap_or(u64::MAX),
                    available: root.len,
                })
            }
        };
        self.views.insert(view_key.to_string(), view);
        Ok(view)
    }
}

fn header(reason: impl Into<String>) -> TorchError {
    TorchError::LegacyHeader {
        reason: reason.into(),
    }
}

fn str_of(p: &Pickle, id: ObjId) -> Option<String> {
    let o = p.arena(id)?;
    match (o.as_str(), o.as_bytes()) {
        (Some(s), _) => Some(s.to_string()),
        (_, Some(b)) => std::str::from_utf8(b).ok().map(str::to_string),
        _ => None,
    }
}

/// Read a legacy file: the main pickle and its storages, located in `bytes`.
pub fn read<'a>(
    bytes: &'a [u8],
    limits: &Limits,
) -> Result<(Pickle<'a>, Vec<Storage>), TorchError> {
    // The header pickles are tiny; their own bounds, whatever the main pickle's.
    let small = Limits {
        max_pickle_bytes: 1 << 20,
        max_objects: 4096,
        ..limits.clone()
    };
    let magic = pickle::unpickle(bytes, "legacy magic number", &small, &mut NoStorages)?;
    let mut pos = magic.end;
    match &*magic.get(magic.root) {
        Object::BigInt(b) if **b == MAGIC => {}
        other => return Err(header(format!("the magic number is {}", other.kind()))),
    }
    let version = pickle::unpickle(
        &bytes[pos..],
        "legacy protocol version",
        &small,
        &mut NoStorages,
    )?;
    pos += version.end;
    match &*version.get(version.root) {
        Object::Int(PROTOCOL_VERSION) => {}
        Object::Int(v) => return Err(header(format!("protocol version {v}, expected 1001"))),
        other => return Err(header(format!("the protocol version is {}", other.kind()))),
    }
    let info = pickle::unpickle(&bytes[pos..], "legacy sys_info", &small, &mut NoStorages)?;
    pos += info.end;
    let mut little_endian = true;
    match &*info.get(info.root) {
        Object::Dict(d) => {
            for &(k, v) in &d.items {
                if str_of(&info, k).as_deref() == Some("little_endian") {
                    little_endian = !matches!(&*info.get(v), Object::Bool(false));
                }
            }
        }
        other => return Err(header(format!("sys_info is {}", other.kind()))),
    }

    let mut loader = LegacyStorages {
        storages: Vec::new(),
        by_key: HashMap::new(),
        views: HashMap::new(),
    };
    let main = pickle::unpickle(&bytes[pos..], "legacy pickle", limits, &mut loader)?;
    pos += main.end;
    let keys = pickle::unpickle(
        &bytes[pos..],
        "legacy storage keys",
        limits,
        &mut NoStorages,
    )?;
    pos += keys.end;
    let ids: Vec<ObjId> = match &*keys.get(keys.root) {
        Object::List(l) => l.to_vec(),
        Object::Tuple(t) => t.to_vec(),
        other => {
            return Err(TorchError::LegacyKeys {
                reason: format!("it is {}, not a list", other.kind()),
            })
        }
    };
    let mut storages = loader.storages;
    let mut located = vec![false; storages.len()];
    let mut pos = pos as u64;
    let file_len = bytes.len() as u64;
    for id in ids {
        let Some(key) = str_of(&keys, id) else {
            return Err(TorchError::LegacyKeys {
                reason: format!("a key is {}", keys.get(id).kind()),
            });
        };
        let Some(&index) = loader.by_key.get(&key) else {
            return Err(TorchError::LegacyKeys {
                reason: format!("it lists storage `{key}`, which no persistent id names"),
            });
        };
        if located[index] {
            return Err(TorchError::LegacyKeys {
                reason: format!("it lists storage `{key}` twice"),
            });
        }
        let s = &mut storages[index];
        let count_at = usize::try_from(pos).ok();
        let raw = count_at.and_then(|p| bytes.get(p..p.checked_add(8)?));
        let Some(raw) = raw else {
            return Err(TorchError::LegacyTruncated {
                key,
                need: 8,
                have: file_len.saturating_sub(pos),
            });
        };
        let mut a = [0u8; 8];
        a.copy_from_slice(raw);
        let (le, be) = (u64::from_le_bytes(a), u64::from_be_bytes(a));
        let be_ok = !little_endian && be == s.numel;
        if le != s.numel && !be_ok {
            return Err(TorchError::LegacyCount {
                key,
                found: le,
                expected: s.numel,
            });
        }
        let start = pos + 8;
        let end = start.checked_add(s.len).filter(|&e| e <= file_len);
        let Some(end) = end else {
            return Err(TorchError::LegacyTruncated {
                key,
                need: s.len,
                have: file_len.saturating_sub(start),
            });
        };
        s.offset = start;
        located[index] = true;
        pos = end;
    }
    if let Some(i) = located.iter().position(|&l| !l) {
        return Err(TorchError::LegacyKeys {
            reason: format!(
                "storage `{}` is used by the pickle but not stored",
                storages[i].key
            ),
        });
    }
    Ok((main, storages))
}
