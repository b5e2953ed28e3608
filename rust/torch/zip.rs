//! The zip container of `torch.save` (torch >= 1.6), parsed over the mapped file.
//!
//! Only the end record, the ZIP64 end record and the central directory are read, plus each
//! entry's 30-byte local header for the data offset; entry data is never read here, and
//! nothing is ever decompressed. An encrypted entry is refused; a compressed one is listed
//! (with its method), and refused by the reader only where it reads the entry: `data.pkl`,
//! `byteorder` and storages must be stored (torch writes every entry stored, but a re-zipped
//! file may deflate `.format_version` or a TorchScript archive's `code/`). Sizes come from
//! the central directory (torch sets flag bit 3, so local headers hold zeros).

use super::error::TorchError;

const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;
const EOCD_LEN: usize = 22;
const CENTRAL_LEN: u64 = 46;
const LOCAL_LEN: u64 = 30;

/// One stored entry: where its header and data lie in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZipEntry {
    pub name: Box<str>,
    /// Offset of the local header.
    pub header: u64,
    /// Offset of the first data byte.
    pub data: u64,
    /// Data length in the file (for a stored entry, also its uncompressed length).
    pub size: u64,
    /// The compression method, 0 for a stored entry (whose data can be mapped in place).
    pub method: u16,
}

/// The archive's entries, in central-directory order, with a name index.
#[derive(Debug, Clone, Default)]
pub struct ZipArchive {
    pub entries: Vec<ZipEntry>,
    /// Indices into `entries` in order of name (unique names), for binary search: no
    /// second copy of the names (500k storages' entries cost a hash map of their names
    /// some 40 MB and a second of hashing).
    pub by_name: Vec<u32>,
}

impl ZipArchive {
    pub fn get(&self, name: &str) -> Option<&ZipEntry> {
        let i = self
            .by_name
            .binary_search_by(|&i| (*self.entries[i as usize].name).cmp(name))
            .ok()?;
        self.entries.get(self.by_name[i] as usize)
    }

    /// The entry `name`, which the reader maps in place, so it must be stored.
    pub fn get_stored(&self, name: &str) -> Result<Option<&ZipEntry>, TorchError> {
        match self.get(name) {
            Some(e) if e.method != 0 => Err(TorchError::ZipCompressed {
                entry: e.name.to_string(),
                method: e.method,
            }),
            other => Ok(other),
        }
    }

    /// The entry's data within `bytes` (validated at parse time against the same bytes).
    pub fn data<'a>(&self, bytes: &'a [u8], entry: &ZipEntry) -> &'a [u8] {
        let start = usize::try_from(entry.data).unwrap_or(usize::MAX);
        let end = usize::try_from(entry.data.saturating_add(entry.size)).unwrap_or(usize::MAX);
        bytes.get(start..end).unwrap_or(&[])
    }
}

fn dir(reason: impl Into<String>) -> TorchError {
    TorchError::ZipDirectory {
        reason: reason.into(),
    }
}

fn at(bytes: &[u8], pos: u64, len: usize) -> Option<&[u8]> {
    let pos = usize::try_from(pos).ok()?;
    bytes.get(pos..pos.checked_add(len)?)
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

/// Whether `bytes` starts like a zip archive (a local header, or an empty archive's end).
pub fn looks_like_zip(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06")
}

/// The name of the first local header, if there is one.
pub fn first_name(bytes: &[u8]) -> Option<&[u8]> {
    let h = at(bytes, 0, LOCAL_LEN as usize)?;
    if u32_at(h, 0) != LOCAL_SIG {
        return None;
    }
    at(bytes, LOCAL_LEN, usize::from(u16_at(h, 26)))
}

/// Whether a name could escape a folder it is extracted into.
fn unsafe_name(name: &str) -> bool {
    name.is_empty()
        || name.starts_with('/')
        || name.starts_with('\\')
        || name.contains('\0')
        || name.as_bytes().get(1) == Some(&b':')
        || name.split(['/', '\\']).any(|c| c == "..")
}

struct End {
    entries: u64,
    cd_size: u64,
    cd_offset: u64,
    /// Where the central directory must end: the ZIP64 end record, or the end record.
    limit: u64,
}

fn find_end(bytes: &[u8]) -> Result<End, TorchError> {
    if bytes.len() < EOCD_LEN {
        return Err(TorchError::ZipNoEnd);
    }
    let last = bytes.len() - EOCD_LEN;
    let first = last.saturating_sub(u16::MAX as usize);
    let pos = (first..=last)
        .rev()
        .find(|&p| {
            let e = &bytes[p..p + EOCD_LEN];
            u32_at(e, 0) == EOCD_SIG && p + EOCD_LEN + usize::from(u16_at(e, 20)) == bytes.len()
        })
        .ok_or(TorchError::ZipNoEnd)?;
    let e = &bytes[pos..pos + EOCD_LEN];
    let (disk, cd_disk) = (u16_at(e, 4), u16_at(e, 6));
    let (on_disk, total) = (u16_at(e, 8), u16_at(e, 10));
    let (cd_size, cd_offset) = (u32_at(e, 12), u32_at(e, 16));
    let locator = pos
        .checked_sub(20)
        .map(|p| &bytes[p..p + 20])
        .filter(|l| u32_at(l, 0) == ZIP64_LOCATOR_SIG);
    let Some(loc) = locator else {
        if disk != 0 || cd_disk != 0 || on_disk != total {
            return Err(dir("the archive spans several disks"));
        }
        return Ok(End {
            entries: u64::from(total),
            cd_size: u64::from(cd_size),
            cd_offset: u64::from(cd_offset),
            limit: pos as u64,
        });
    };
    let loc_pos = (pos - 20) as u64;
    if u32_at(loc, 4) != 0 || u32_at(loc, 16) > 1 {
        return Err(dir("the archive spans several disks"));
    }
    let z_off = u64_at(loc, 8);
    let z = at(bytes, z_off, 56)
        .filter(|_| z_off.checked_add(56).is_some_and(|e| e <= loc_pos))
        .ok_or_else(|| {
            dir(format!(
                "the zip64 end record at {z_off} lies outside the file"
            ))
        })?;
    if u32_at(z, 0) != ZIP64_EOCD_SIG {
        return Err(dir(format!("no zip64 end record at {z_off}")));
    }
    if u32_at(z, 16) != 0 || u32_at(z, 20) != 0 || u64_at(z, 24) != u64_at(z, 32) {
        return Err(dir("the archive spans several disks"));
    }
    let entries = u64_at(z, 32);
    let (z_size, z_offset) = (u64_at(z, 40), u64_at(z, 48));
    // Where the classic record holds a real value, it must agree with the zip64 one.
    let agrees = |small: u64, sentinel: u64, big: u64| small == sentinel || small == big;
    if !agrees(u64::from(total), 0xffff, entries)
        || !agrees(u64::from(cd_size), 0xffff_ffff, z_size)
        || !agrees(u64::from(cd_offset), 0xffff_ffff, z_offset)
    {
        return Err(dir("the end record and the zip64 end record disagree"));
    }
    Ok(End {
        entries,
        cd_size: z_size,
        cd_offset: z_offset,
        limit: z_off,
    })
}

/// Parse and check the central directory of the zip archive `bytes` (the whole file).
pub fn parse(bytes: &[u8]) -> Result<ZipArchive, TorchError> {
    let end = find_end(bytes)?;
    let cd_end = end
        .cd_offset
        .checked_add(end.cd_size)
        .filter(|&e| e <= end.limit)
        .ok_or_else(|| {
            dir(format!(
                "{} bytes at offset {} do not fit before the end record at {}",
                end.cd_size, end.cd_offset, end.limit
            ))
        })?;
    if end.entries.saturating_mul(CENTRAL_LEN) > end.cd_size {
        return Err(dir(format!(
            "{} entries cannot fit in {} bytes",
            end.entries, end.cd_size
        )));
    }
    if u32::try_from(end.entries).is_err() {
        return Err(dir(format!("{} entries are too many", end.entries)));
    }
    // The count is bounded by the directory's size, which lies within the file.
    let mut archive = ZipArchive {
        entries: Vec::with_capacity(end.entries as usize),
        by_name: Vec::new(),
    };
    let mut p = end.cd_offset;
    for i in 0..end.entries {
        let h = at(bytes, p, CENTRAL_LEN as usize)
            .filter(|_| p + CENTRAL_LEN <= cd_end)
            .ok_or_else(|| dir(format!("entry {i} runs past the directory's end")))?;
        if u32_at(h, 0) != CENTRAL_SIG {
            return Err(dir(format!("entry {i} has no central header signature")));
        }
        let flags = u16_at(h, 8);
        let method = u16_at(h, 10);
        let (mut csize, mut usize_) = (u64::from(u32_at(h, 20)), u64::from(u32_at(h, 24)));
        let (nlen, elen, clen) = (
            u64::from(u16_at(h, 28)),
            u64::from(u16_at(h, 30)),
            u64::from(u16_at(h, 32)),
        );
        let mut disk = u32::from(u16_at(h, 34));
        let mut header = u64::from(u32_at(h, 42));
        let next = p + CENTRAL_LEN + nlen + elen + clen;
        if next > cd_end {
            return Err(dir(format!("entry {i} runs past the directory's end")));
        }
        let raw_name = at(bytes, p + CENTRAL_LEN, nlen as usize).unwrap_or(&[]);
        let name = String::from_utf8_lossy(raw_name).into_owned();
        let extra = at(bytes, p + CENTRAL_LEN + nlen, elen as usize).unwrap_or(&[]);
        // ZIP64 extended information: the fields whose classic value is all ones, in order.
        let mut x = 0usize;
        while x + 4 <= extra.len() {
            let (id, len) = (u16_at(extra, x), usize::from(u16_at(extra, x + 2)));
            let body = extra
                .get(x + 4..x + 4 + len)
                .ok_or_else(|| TorchError::ZipEntry {
                    entry: name.clone(),
                    reason: "an extra field runs past its end".into(),
                })?;
            if id == 1 {
                let mut b = 0usize;
                let mut next_u64 = |field: &mut u64| -> Result<(), TorchError> {
                    if *field == 0xffff_ffff {
                        let v = body.get(b..b + 8).ok_or_else(|| TorchError::ZipEntry {
                            entry: name.clone(),
                            reason: "its zip64 extra field is too short".into(),
                        })?;
                        *field = u64_at(v, 0);
                        b += 8;
                    }
                    Ok(())
                };
                next_u64(&mut usize_)?;
                next_u64(&mut csize)?;
                next_u64(&mut header)?;
                if disk == 0xffff {
                    disk = body.get(b..b + 4).map_or(disk, |v| u32_at(v, 0));
                }
            }
            x += 4 + len;
        }
        p = next;

        if std::str::from_utf8(raw_name).is_err() || unsafe_name(&name) {
            return Err(TorchError::ZipUnsafeName { entry: name });
        }
        if flags & 1 != 0 {
            return Err(TorchError::ZipEncrypted { entry: name });
        }
        if disk != 0 {
            return Err(TorchError::ZipEntry {
                entry: name,
                reason: format!("it lies on disk {disk}"),
            });
        }
        if method == 0 && csize != usize_ {
            return Err(TorchError::ZipEntry {
                entry: name,
                reason: format!("stored, yet its sizes differ ({csize} and {usize_})"),
            });
        }
        let local = at(bytes, header, LOCAL_LEN as usize)
            .filter(|_| header.saturating_add(LOCAL_LEN) <= end.cd_offset)
            .ok_or_else(|| TorchError::ZipEntry {
                entry: name.clone(),
                reason: format!("its local header at {header} lies outside the file's data"),
            })?;
        if u32_at(local, 0) != LOCAL_SIG {
            return Err(TorchError::ZipEntry {
                entry: name,
                reason: format!("no local header signature at {header}"),
            });
        }
        let lnlen = u64::from(u16_at(local, 26));
        let lelen = u64::from(u16_at(local, 28));
        let data = header + LOCAL_LEN + lnlen + lelen;
        let data_end = data.checked_add(csize).filter(|&e| e <= end.cd_offset);
        let Some(_) = data_end else {
            return Err(TorchError::ZipEntry {
                entry: name,
                reason: format!(
                    "its {csize} bytes at offset {data} run past the start of the directory at {}",
                    end.cd_offset
                ),
            });
        };
        if at(bytes, header + LOCAL_LEN, lnlen as usize) != Some(raw_name) {
            return Err(TorchError::ZipEntry {
                entry: name,
                reason: "its local header names another entry".into(),
            });
        }
        archive.entries.push(ZipEntry {
            name: name.into_boxed_str(),
            header,
            data,
            size: csize,
            method,
        });
    }
    // No two entries may share a name: of the names that repeat, the one repeated first
    // in directory order is reported.
    let entries = &archive.entries;
    let mut by_name: Vec<u32> = (0..entries.len() as u32).collect();
    by_name.sort_unstable_by(|&a, &b| {
        let (x, y) = (&entries[a as usize], &entries[b as usize]);
        x.name.cmp(&y.name).then(a.cmp(&b))
    });
    let repeat = by_name
        .windows(2)
        .filter(|w| entries[w[0] as usize].name == entries[w[1] as usize].name)
        .map(|w| w[1])
        .min();
    if let Some(i) = repeat {
        return Err(TorchError::ZipDuplicate {
            entry: entries[i as usize].name.to_string(),
        });
    }
    archive.by_name = by_name;
    // No two entries may share bytes (header through data).
    let mut order: Vec<usize> = (0..archive.entries.len()).collect();
    order.sort_by_key(|&i| archive.entries[i].header);
    for w in order.windows(2) {
        let (a, b) = (&archive.entries[w[0]], &archive.entries[w[1]]);
        if b.header < a.data + a.size {
            return Err(TorchError::ZipOverlap {
                entry: b.name.to_string(),
                other: a.name.to_string(),
            });
        }
    }
    Ok(archive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for bad in [
            "",
            "/etc/passwd",
            "a/../../b",
            "..",
            "C:/x",
            "a\\..\\b",
            "a\0b",
        ] {
            assert!(unsafe_name(bad), "{bad:?}");
        }
        for good in ["archive/data.pkl", "a/data/0", "x..y/z", ".data/version"] {
            assert!(!unsafe_name(good), "{good:?}");
        }
    }

    #[test]
    fn not_a_zip() {
        assert_eq!(parse(b"").unwrap_err(), TorchError::ZipNoEnd);
        assert_eq!(parse(&[0u8; 100]).unwrap_err(), TorchError::ZipNoEnd);
    }
}
