//! Manifests: what a folder run has planned and written into its destination.
//!
//! Each run (a whole-folder run, or one `--shard i/N` run) keeps its own manifest in the
//! destination, written before its first output and after each file it publishes. It names
//! the source (by path and by device and inode), the options, the files the run plans to
//! write, and for each file written its device, inode and size and what `--resume` needs to
//! trust it. Other runs read it to know which files are stcast's (so N shard runs can share
//! a destination, and a foreign folder is refused), and a run replaces or removes only files
//! a manifest records it wrote, with their identity unchanged (`proves`: the claims of issue
//! 23). A finished run removes the manifests, so the destination can be uploaded as it is.
//!
//! The document is JSON as Python's `json.dumps(doc, indent=1)` writes it (`run::json`);
//! file names that are not UTF-8 are spelled as Python's `surrogateescape` reads them.

use std::borrow::Cow;
use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;

use crate::error::{Error, ManifestProblem, Result};
use crate::output::{self, Replace};
use crate::run::json::{self, Dump, Node, Str, Value};
use crate::run::place::{ident, lstat, Ident};
use crate::vocab::{ErrorKind, Target};
use crate::VERSION;

/// The whole run's manifest; a shard run's is `file_name(Some((i, n)))`.
pub const MANIFEST: &str = ".stcast-manifest.json";
const SHARD_PREFIX: &[u8] = b".stcast-manifest.shard-";
/// The document format this stcast writes and reads.
pub const FORMAT: u64 = 2;
/// A manifest lists at most every file of a checkpoint: far below this.
const MAX_MANIFEST: u64 = 64 << 20;
/// The most shards a run may be split into (as `--shard` allows).
pub const MAX_SHARDS: u64 = (1 << 32) - 1;
/// How deeply a manifest nests (an entry's list of inputs is the deepest).
const MAX_DEPTH: usize = 8;

/// A shard run's `(i, n)`.
pub type Shard = (u64, u64);

/// The manifest file of a run: the whole run's, or shard `i` of `n`'s.
pub fn file_name(shard: Option<Shard>) -> String {
    match shard {
        None => MANIFEST.into(),
        Some((i, n)) => format!(".stcast-manifest.shard-{i}-of-{n}.json"),
    }
}

/// Is `name` a manifest's: the whole run's, or `.stcast-manifest.shard-I-of-N.json`?
pub fn is_manifest(name: &[u8]) -> bool {
    let digits = |s: &[u8]| !s.is_empty() && s.iter().all(u8::is_ascii_digit);
    let rest = name.strip_prefix(SHARD_PREFIX);
    let rest = rest.and_then(|r| r.strip_suffix(b".json"));
    let pair = rest.and_then(|r| {
        let at = r.windows(4).position(|w| w == b"-of-")?;
        Some((&r[..at], &r[at + 4..]))
    });
    name == MANIFEST.as_bytes() || pair.is_some_and(|(i, n)| digits(i) && digits(n))
}

/// That a file this run may have published (or that stcast wrote and this run has not yet
/// replaced or removed) is the one with this identity, size and (`""`: unknown) header hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub header: String,
    /// Its birth time (`born`), where the file system keeps one.
    pub born: Option<u64>,
    /// A file claimed as found (no header hash to name it): its modification time, in
    /// nanoseconds since the epoch; one edited in place since (a config, the same size) is
    /// the user's again.
    pub mtime: Option<u64>,
}

/// A file a run published: its identity, and the whole entry as the manifest holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub dev: u64,
    pub ino: u64,
    pub size: Option<u64>,
    /// Its birth time (`born`), where the file system keeps one.
    pub born: Option<u64>,
    pub node: Node<'static>,
}

impl Entry {
    /// Is `m` (still) the file this entry records?
    fn is(&self, m: &std::fs::Metadata) -> bool {
        is(m, (self.dev, self.ino), self.born)
    }
}

/// One run's record, saved as `dst/name`.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub dst: PathBuf,
    pub name: String,
    pub src: OsString,
    pub src_id: Ident,
    pub options: Node<'static>,
    pub allow_quantized: Option<bool>,
    pub shard: Option<Shard>,
    pub planned: Vec<OsString>,
    pub complete: bool,
    /// Written by `finalize` (which completes shard runs), not by a conversion.
    pub finalize: bool,
    /// rel -> its entry, in the order published (a map: a run of 10,000 small files looks
    /// each up as it records it).
    pub files: IndexMap<OsString, Entry>,
    /// Files this run may have published, or that stcast wrote and this run has not yet
    /// replaced or removed: a file there with a claimed identity is proven stcast's. An
    /// output is claimed once sealed, before it has a name (a link or a rename keeps its
    /// inode), so a run killed just after publishing it still proves it wrote it.
    pub pending: Vec<(OsString, Vec<Claim>)>,
    /// The identity this run last published the manifest with (None: not yet).
    pub published: Option<Ident>,
    /// What the first save may replace at its name: nothing (another run's manifest there
    /// makes it fail), or, told to (`force`), the file the survey found there.
    pub first_replace: Option<Ident>,
    /// This run's mark in what it saves: a device and inode can be another file's once the
    /// file is gone (a rival's manifest replacing this one may take its inode number).
    token: String,
    /// Has this run saved it (so that the file there holds `token`)?
    saved: bool,
}

fn refused(path: PathBuf, problem: ManifestProblem) -> Error {
    Error::Manifest { path, problem }
}

/// The birth time of the file `m` describes, in nanoseconds since the epoch (statx's
/// `btime`), where the file system keeps one. A device and inode are another file's once
/// the file is gone (a user's new file may take its inode number): a record holds both, so
/// that only the file stcast wrote is proven its, and never the one that took its place.
fn born(m: &std::fs::Metadata) -> Option<u64> {
    nanos(m.created())
}

/// The modification time of the file `m` describes, in nanoseconds since the epoch.
fn mtime(m: &std::fs::Metadata) -> Option<u64> {
    nanos(m.modified())
}

/// A time a file system gave, in nanoseconds since the epoch (None: not kept, or before).
fn nanos(t: std::io::Result<std::time::SystemTime>) -> Option<u64> {
    let t = t.ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
    u64::try_from(t.as_nanos()).ok()
}

/// Is `m` the file of identity `id` born at `at` (None: not known, on either side)?
fn is(m: &std::fs::Metadata, id: Ident, at: Option<u64>) -> bool {
    ident(m) == id && (at.is_none() || born(m).is_none() || born(m) == at)
}

/// A file name as Python holds it (`surrogateescape`): bytes that are not UTF-8 as lone
/// surrogates U+DC80..U+DCFF.
pub fn name_str(name: &OsStr) -> Str<'static> {
    if let Some(t) = name.to_str() {
        return Str::Text(Cow::Owned(t.into()));
    }
    let mut points = Vec::new();
    for chunk in name.as_bytes().utf8_chunks() {
        points.extend(chunk.valid().chars().map(u32::from));
        points.extend(chunk.invalid().iter().map(|&b| 0xdc00 + u32::from(b)));
    }
    Str::Wide(points)
}

/// The file name a string spells (`name_str` backwards); None for one no name has.
pub fn str_name(s: &Str<'_>) -> Option<OsString> {
    let points = match s {
        Str::Text(t) => return Some(OsString::from(t.as_ref())),
        Str::Wide(w) => w,
    };
    let mut out = Vec::new();
    for &p in points {
        match p {
            0xdc80..=0xdcff => out.push((p - 0xdc00) as u8),
            _ => out.extend(char::from_u32(p)?.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    Some(OsString::from_vec(out))
}

fn node(value: Value<'static>) -> Node<'static> {
    Node {
        value,
        span: (0, 0),
    }
}

fn number(n: u64) -> Node<'static> {
    node(Value::Number(Cow::Owned(n.to_string())))
}

fn text(s: &str) -> Node<'static> {
    node(Value::Str(Str::Text(Cow::Owned(s.into()))))
}

fn flag(b: bool) -> Node<'static> {
    node(Value::Literal(if b { "true" } else { "false" }))
}

fn object(members: Vec<(Str<'static>, Node<'static>)>) -> Node<'static> {
    node(Value::Object(members))
}

fn key(k: &str) -> Str<'static> {
    Str::Text(Cow::Owned(k.into()))
}

fn own(s: &Str<'_>) -> Str<'static> {
    match s {
        Str::Text(t) => Str::Text(Cow::Owned(t.to_string())),
        Str::Wide(w) => Str::Wide(w.clone()),
    }
}

/// A copy of `n` that owns its strings (the text it was read from may go).
pub fn owned(n: &Node<'_>) -> Node<'static> {
    node(match &n.value {
        Value::Literal(l) => Value::Literal(l),
        Value::Number(x) => Value::Number(Cow::Owned(x.to_string())),
        Value::Str(s) => Value::Str(own(s)),
        Value::Array(items) => Value::Array(items.iter().map(owned).collect()),
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (own(k), owned(v))).collect()),
    })
}

/// An object as Python's dict holds it, each level's keys sorted (`json.dumps(sort_keys=True)`).
fn sorted(n: &Node<'_>) -> Node<'static> {
    match (&n.value, n.dict()) {
        (Value::Object(_), Some(mut members)) => {
            members.sort_by(|a, b| a.0.cmp(b.0));
            object(
                members
                    .into_iter()
                    .map(|(k, v)| (own(k), sorted(v)))
                    .collect(),
            )
        }
        (Value::Array(items), _) => node(Value::Array(items.iter().map(sorted).collect())),
        _ => owned(n),
    }
}

/// `n` as `json.dumps(n, sort_keys=True)` writes it: what two documents equal as Python
/// compares them (key order aside) share.
fn canonical(n: &Node<'_>) -> String {
    let mut dump = Dump::indented(None);
    dump.sort_keys = true;
    dump.text(n)
}

/// A whole number in `0..2**64` (not a bool, not `1.0`).
fn whole(n: Option<&Node<'_>>) -> Option<u64> {
    match &n?.value {
        Value::Number(x) => x.parse().ok(),
        _ => None,
    }
}

/// A whole number that may be absent (`Some(None)`); None: not a whole number.
fn optional(n: Option<&Node<'_>>) -> Option<Option<u64>> {
    n.map_or(Some(None), |n| whole(Some(n)).map(Some))
}

fn string<'n, 'a>(n: Option<&'n Node<'a>>) -> Option<&'n Str<'a>> {
    match &n?.value {
        Value::Str(s) => Some(s),
        _ => None,
    }
}

/// SHA-256 of a safetensors file's length prefix and header; "" for a file that is none.
pub fn header_sha256(path: &Path) -> Result<String> {
    match crate::source::read_header(path) {
        Ok(h) => Ok(h.1),
        Err(e) if e.kind() == ErrorKind::InvalidInput => Ok(String::new()),
        Err(e) => Err(e),
    }
}

/// An input file of an output unit, as the unit's entry names it (what `--resume` compares).
pub struct Input<'a> {
    pub rel: &'a OsStr,
    pub size: u64,
    pub mtime_ns: i64,
    /// Its fingerprint (`folder::fingerprint`).
    pub hash: &'a str,
}

/// How an entry names the inputs of a unit: its one input flat (`source_*`), several as a
/// list (with their paths).
fn input_members(inputs: &[Input<'_>]) -> Vec<(&'static str, Node<'static>)> {
    let signed = |n: i64| node(Value::Number(Cow::Owned(n.to_string())));
    if let [one] = inputs {
        return vec![
            ("source_size", number(one.size)),
            ("source_mtime_ns", signed(one.mtime_ns)),
            ("source_header_sha256", text(one.hash)),
        ];
    }
    vec![("inputs", listed(inputs))]
}

/// The inputs of a unit as a list: each one's path, size, mtime and fingerprint.
fn listed(inputs: &[Input<'_>]) -> Node<'static> {
    let signed = |n: i64| node(Value::Number(Cow::Owned(n.to_string())));
    let listed = inputs.iter().map(|f| {
        let rel = node(Value::Str(name_str(f.rel)));
        node(Value::Array(vec![
            rel,
            number(f.size),
            signed(f.mtime_ns),
            text(f.hash),
        ]))
    });
    node(Value::Array(listed.collect()))
}

/// What `resume` and `finalize` need to trust an output unit without reading it: the
/// inputs it reads as they were, the options (`options`), the number of shard runs
/// (`shards`), and its header as written (`header`).
pub fn unit_entry(
    inputs: &[Input<'_>],
    options: &Node<'_>,
    shards: Option<u64>,
    header: &str,
) -> Node<'static> {
    let mut members: Vec<_> = (input_members(inputs).into_iter())
        .map(|(k, v)| (key(k), v))
        .collect();
    members.extend([
        (key("options"), owned(options)),
        (key("version"), text(VERSION)),
        (
            key("shards"),
            shards.map_or(node(Value::Literal("null")), number),
        ),
        (key("output_header_sha256"), text(header)),
    ]);
    object(members)
}

/// The header `entry` records, if it is of an output unit reading `inputs` unchanged,
/// written by this version with `options` (and, given `planned`, of that header). An entry
/// may list one input too (as stcast wrote an output shard's before plain runs were
/// one-file groups): trusted the same.
pub fn unit_matches<'e>(
    entry: &'e Node<'_>,
    inputs: &[Input<'_>],
    options: &Node<'_>,
    planned: Option<&str>,
) -> Option<&'e str> {
    let same = |a: Option<&Node<'_>>, b: &Node<'_>| a.is_some_and(|a| canonical(a) == canonical(b));
    let Some(Str::Text(recorded)) = string(entry.get("output_header_sha256")) else {
        return None;
    };
    let same_inputs = match entry.get("inputs") {
        Some(list) => same(Some(list), &listed(inputs)),
        None => input_members(inputs)
            .iter()
            .all(|(k, v)| same(entry.get(k), v)),
    };
    let version = matches!(string(entry.get("version")), Some(Str::Text(v)) if v == VERSION);
    let ok = same_inputs && version && same(entry.get("options"), options);
    (ok && planned.is_none_or(|p| p == recorded)).then_some(recorded.as_ref())
}

/// The whole content of the regular file `path`, at most `MAX_MANIFEST` bytes; the
/// reason it cannot be read.
fn read_bounded(path: &Path) -> std::result::Result<Vec<u8>, String> {
    let (file, meta) = crate::source::open_regular(path).map_err(|e| e.message())?;
    if meta.len() > MAX_MANIFEST {
        return Err(format!(
            "{}, more than the {} a manifest may have",
            crate::text::format_bytes(meta.len()),
            crate::text::format_bytes(MAX_MANIFEST)
        ));
    }
    let mut bytes = Vec::new();
    // One byte more reveals a file that grew.
    (&file)
        .take(meta.len() + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot be read ({e})"))?;
    if bytes.len() as u64 != meta.len() {
        return Err(format!(
            "its size says {} bytes, reading it gave another",
            meta.len()
        ));
    }
    Ok(bytes)
}

/// A manifest in the destination that cannot be read: its path, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub path: PathBuf,
    pub reason: String,
}

impl Unreadable {
    /// The refusal of a run (`finalize`: of `finalize`) that found it.
    pub fn refusal(self, finalize: bool) -> Error {
        let reason = self.reason;
        refused(self.path, ManifestProblem::Unreadable { reason, finalize })
    }
}

impl Manifest {
    /// The record of a run about to start, not yet saved.
    pub fn new(
        src: &Path,
        src_id: Ident,
        dst: &Path,
        options: Node<'static>,
        allow_quantized: Option<bool>,
        shard: Option<Shard>,
        planned: Vec<OsString>,
    ) -> Manifest {
        let src = std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf());
        // The system call, never glibc's wrapper (`output::random_suffix`).
        let mut random = [0u8; 16];
        random[..8].copy_from_slice(&output::random_suffix().to_le_bytes());
        random[8..].copy_from_slice(&output::random_suffix().to_le_bytes());
        Manifest {
            dst: dst.to_path_buf(),
            name: file_name(shard),
            src: src.into_os_string(),
            src_id,
            options,
            allow_quantized,
            shard,
            planned,
            complete: false,
            finalize: false,
            files: IndexMap::new(),
            pending: Vec::new(),
            published: None,
            first_replace: None,
            token: random.iter().map(|b| format!("{b:02x}")).collect(),
            saved: false,
        }
    }

    /// Where it is saved.
    pub fn path(&self) -> PathBuf {
        self.dst.join(&self.name)
    }

    /// The entry of `rel`, if this run published it.
    pub fn entry(&self, rel: &OsStr) -> Option<&Entry> {
        self.files.get(rel)
    }

    /// Note that `rel` may be (or become) the file `(dev, ino, size)` stcast wrote, its
    /// header hash `header` ("": unknown).
    pub fn claim(&mut self, rel: &OsStr, (dev, ino, size): (u64, u64, u64), header: &str) {
        self.claim_as_found(rel, (dev, ino, size), header, None);
    }

    /// `claim`, of a file as found there (`m`, None: not known): its birth and modification
    /// times too.
    fn claim_as_found(
        &mut self,
        rel: &OsStr,
        id: (u64, u64, u64),
        header: &str,
        m: Option<&std::fs::Metadata>,
    ) {
        let (dev, ino, size) = id;
        let claim = Claim {
            dev,
            ino,
            size,
            header: header.into(),
            born: m.and_then(born),
            mtime: m.and_then(mtime),
        };
        match self.pending.iter_mut().find(|(r, _)| r == rel) {
            Some((_, claims)) => {
                claims.retain(|c| (c.dev, c.ino) != (dev, ino));
                claims.push(claim);
            }
            None => self.pending.push((rel.to_os_string(), vec![claim])),
        }
    }

    /// The identity and size of `dst/rel` as it is now.
    pub fn identity(&self, rel: &OsStr) -> Result<(u64, u64, u64)> {
        let path = self.dst.join(rel);
        let m = std::fs::symlink_metadata(&path).map_err(|e| Error::io(&path, "cannot stat", e))?;
        Ok((m.dev(), m.ino(), m.size()))
    }

    /// Forget the claims on `rel` (a file this run removed, or recorded).
    pub fn forget(&mut self, rel: &OsStr) {
        self.pending.retain(|(r, _)| r != rel);
    }

    /// Note that this run published `rel` as `(dev, ino, size)` of `kind`; `extra`: the
    /// members (an object) that `--resume` and `finalize` need to trust it.
    pub fn record(&mut self, rel: &OsStr, kind: &str, id: (u64, u64, u64), extra: Option<&Node>) {
        let (dev, ino, size) = id;
        // (Published a moment ago: the file there is the one this run wrote, unless gone.)
        let now = lstat(&self.dst.join(rel)).ok().flatten();
        let born = now
            .filter(|m| ident(m) == (dev, ino))
            .and_then(|m| born(&m));
        let mut members = vec![
            (key("kind"), text(kind)),
            (key("dev"), number(dev)),
            (key("ino"), number(ino)),
            (key("size"), number(size)),
        ];
        for (k, v) in extra.and_then(Node::dict).unwrap_or_default() {
            match members.iter_mut().find(|(m, _)| m == k) {
                Some(m) => m.1 = owned(v),
                None => members.push((own(k), owned(v))),
            }
        }
        members.retain(|(k, _)| *k != key("born"));
        members.extend(born.map(|b| (key("born"), number(b))));
        let entry = Entry {
            dev,
            ino,
            size: Some(size),
            born,
            node: object(members),
        };
        self.files.insert(rel.to_os_string(), entry);
        self.forget(rel);
    }

    /// Claim each file stcast wrote here (`ours`: rel -> identity) that this record does not
    /// record as done: the earlier manifest that proves it is replaced by this one, and a
    /// run killed before it replaces or removes such a file must still prove it.
    pub fn carry<'a>(
        &mut self,
        ours: impl IntoIterator<Item = (&'a OsString, &'a Ident)>,
    ) -> Result<()> {
        for (rel, id) in ours {
            if self.entry(rel).is_some() {
                continue;
            }
            if let Some(m) = lstat(&self.dst.join(rel))? {
                if ident(&m) == *id {
                    self.claim_as_found(rel, (id.0, id.1, m.size()), "", Some(&m));
                }
            }
        }
        Ok(())
    }

    /// The document, as `json.dumps(doc, indent=1)` writes it (ASCII: any file name, even
    /// one that is not UTF-8, round-trips).
    pub fn text(&self) -> String {
        let names = |v: &[OsString]| {
            node(Value::Array(
                v.iter().map(|n| node(Value::Str(name_str(n)))).collect(),
            ))
        };
        let shard = match self.shard {
            None => node(Value::Literal("null")),
            Some((i, n)) => node(Value::Array(vec![number(i), number(n)])),
        };
        let files = self
            .files
            .iter()
            .map(|(r, e)| (name_str(r), e.node.clone()));
        let claim = |c: &Claim| {
            let mut members = vec![
                (key("dev"), number(c.dev)),
                (key("ino"), number(c.ino)),
                (key("size"), number(c.size)),
                (key("output_header_sha256"), text(&c.header)),
            ];
            members.extend(c.born.map(|b| (key("born"), number(b))));
            members.extend(c.mtime.map(|t| (key("mtime"), number(t))));
            object(members)
        };
        let pending = self.pending.iter().map(|(r, claims)| {
            (
                name_str(r),
                node(Value::Array(claims.iter().map(claim).collect())),
            )
        });
        let doc = object(vec![
            (key("format"), number(FORMAT)),
            (key("version"), text(VERSION)),
            (key("src"), node(Value::Str(name_str(&self.src)))),
            (
                key("src_id"),
                node(Value::Array(vec![
                    number(self.src_id.0),
                    number(self.src_id.1),
                ])),
            ),
            (key("options"), self.options.clone()),
            (
                key("allow_quantized"),
                self.allow_quantized
                    .map_or(node(Value::Literal("null")), flag),
            ),
            (key("shard"), shard),
            (key("planned"), names(&self.planned)),
            (key("complete"), flag(self.complete)),
            (key("files"), object(files.collect())),
            (key("pending"), object(pending.collect())),
            (key("finalize"), flag(self.finalize)),
            (key("run"), text(&self.token)),
        ]);
        Dump::indented(Some(" ")).text(&doc) + "\n"
    }

    /// Write the manifest atomically (the one write path; its temp is locked): over the
    /// file this run last saved, refused if another run took the folder over since.
    pub fn save(&mut self) -> Result<()> {
        if self.published.is_some() {
            self.check_still_ours()?;
        }
        let replace = match self.published.or(self.first_replace) {
            None => Replace::No,
            Some((dev, ino)) => Replace::Same { dev, ino },
        };
        let tag = match self.shard {
            None => "manifest".to_string(),
            Some((i, n)) => format!("s{i}of{n}"),
        };
        let done = output::write_file(&self.path(), self.text().as_bytes(), replace, &tag)?;
        self.published = Some((done.dev, done.ino));
        self.saved = true;
        Ok(())
    }

    /// `save`, once this manifest was saved, unless it is gone: another run completed the
    /// folder and removed it meanwhile (a finalize racing this one). The file about to be
    /// published then finds its name taken, as it would have without the claim.
    pub fn save_claims(&mut self) -> Result<()> {
        if lstat(&self.path())?.is_none() {
            return Ok(());
        }
        self.save()
    }

    /// Refuse to go on once another run took the folder over: this run's manifest was
    /// replaced (another run's `force` or `resume` took it for an interrupted run's) or
    /// removed (that run finished). Writing on would replace that run's files.
    pub fn check_still_ours(&self) -> Result<()> {
        self.check_still_there()?;
        if !self.saved {
            return Ok(());
        }
        // (The same inode number may be another run's manifest: its run token says.)
        let mark = format!("\"run\": \"{}\"", self.token);
        let text = read_bounded(&self.path()).map(String::from_utf8);
        let ours = text.is_ok_and(|t| t.is_ok_and(|t| t.contains(&mark)));
        if ours {
            return Ok(());
        }
        Err(self.taken_over())
    }

    /// `check_still_ours` by identity alone, without reading the manifest back: cheap enough
    /// before each of many small files a save claimed together.
    pub fn check_still_there(&self) -> Result<()> {
        match std::fs::symlink_metadata(self.path()) {
            Ok(m) if Some(ident(&m)) == self.published => Ok(()),
            _ => Err(self.taken_over()),
        }
    }

    /// The refusal of a run whose folder another run took over.
    fn taken_over(&self) -> Error {
        let dst = self.dst.clone();
        refused(self.path(), ManifestProblem::TakenOver { dst })
    }

    /// Before declaring success: every file this run wrote is still the one it wrote.
    pub fn recheck(&self) -> Result<()> {
        for (rel, e) in &self.files {
            let path = self.dst.join(rel);
            let now = lstat(&path)?;
            if !now.is_some_and(|m| e.is(&m) && Some(m.size()) == e.size) {
                return Err(refused(path, ManifestProblem::Changed));
            }
        }
        Ok(())
    }

    /// The files this run published.
    pub fn written(&self) -> Vec<OsString> {
        self.files.iter().map(|(r, _)| r.clone()).collect()
    }

    /// Remove each of `rels` that this run published and that is still that file.
    pub fn unlink_written(&self, rels: &[OsString]) -> Result<()> {
        for rel in rels {
            if let Some(e) = self.entry(rel) {
                self.unlink_if(rel, e)?;
            }
        }
        Ok(())
    }

    /// Unlink `rel` if it is not a folder and still the file entry `e` records: true if
    /// removed.
    fn unlink_if(&self, rel: &OsStr, e: &Entry) -> Result<bool> {
        let path = self.dst.join(rel);
        match lstat(&path)? {
            Some(m) if !m.is_dir() && e.is(&m) => std::fs::remove_file(&path)
                .map(|()| true)
                .map_err(|e| Error::io(&path, "cannot remove", e)),
            _ => Ok(false),
        }
    }

    /// Undo what a failed run added: the files it wrote where nothing was (`before`: what
    /// was there), each still the one it wrote, and its manifest if there was none
    /// (`had_manifest`: an older one of this run's name stays, saved without the files
    /// removed). Returns the files removed. Failures to remove are left for the run's own
    /// failure, the one to report.
    pub fn roll_back(&mut self, before: &HashSet<OsString>, had_manifest: bool) -> Vec<OsString> {
        let mut removed = Vec::new();
        for (rel, e) in &self.files {
            if !before.contains(rel) && self.unlink_if(rel, e).unwrap_or(false) {
                removed.push(rel.clone());
            }
        }
        self.files.retain(|r, _| !removed.contains(r));
        let _ = if had_manifest {
            self.save()
        } else {
            self.remove()
        };
        removed
    }

    /// Remove the manifest, if it is still the one that was read or written.
    pub fn remove(&self) -> Result<()> {
        let path = self.path();
        match lstat(&path)? {
            Some(m) if self.published.is_none_or(|p| p == ident(&m)) => {
                std::fs::remove_file(&path).map_err(|e| Error::io(&path, "cannot remove", e))
            }
            _ => Ok(()),
        }
    }

    /// The manifest `dst/name`, checked field by field.
    pub fn load(dst: &Path, name: &str) -> std::result::Result<Manifest, Unreadable> {
        let path = dst.join(name);
        let bad = |reason: String| Unreadable {
            path: path.clone(),
            reason,
        };
        let raw = read_bounded(&path).map_err(bad)?;
        let text = String::from_utf8(raw)
            .ok()
            .filter(|t| t.is_ascii())
            .ok_or_else(|| bad("cannot be read (not ASCII text)".into()))?;
        let doc = json::parse(&text).map_err(|_| bad("cannot be read (not JSON)".into()))?;
        if doc.dict().is_none() || json::depth(&text) > MAX_DEPTH {
            return Err(bad("not a stcast manifest".into()));
        }
        for k in [
            "format", "shard", "files", "planned", "src_id", "src", "options",
        ] {
            if doc.get(k).is_none() {
                return Err(bad(format!("not a stcast manifest (no '{k}')")));
            }
            if k == "format" {
                let found = doc
                    .get(k)
                    .map(|f| Dump::indented(None).text(f))
                    .unwrap_or_default();
                if found.parse::<f64>().ok() != Some(FORMAT as f64) {
                    return Err(bad(format!(
                        "manifest format {found}; this stcast writes {FORMAT}"
                    )));
                }
            }
        }
        let wrong = || bad("not a stcast manifest (a field has the wrong type)".into());
        let m = Self::fields(dst, name, &doc).ok_or_else(wrong)?;
        let meta = std::fs::metadata(&path).map_err(|e| bad(format!("cannot be read ({e})")))?;
        Ok(Manifest {
            published: Some(ident(&meta)),
            ..m
        })
    }

    /// The fields of a manifest document, if each has its type.
    fn fields(dst: &Path, name: &str, doc: &Node<'_>) -> Option<Manifest> {
        let get = |k| doc.get(k);
        let array = |k| match &get(k)?.value {
            Value::Array(items) => Some(items),
            _ => None,
        };
        let names = |k| -> Option<Vec<OsString>> {
            let items = array(k)?;
            items.iter().map(|n| str_name(string(Some(n))?)).collect()
        };
        let pair = |k| match array(k)?.as_slice() {
            [a, b] => Some((whole(Some(a))?, whole(Some(b))?)),
            _ => None,
        };
        let shard = match &get("shard")?.value {
            Value::Literal("null") => None,
            _ => Some(pair("shard").filter(|&(i, n)| 1 <= i && i <= n && n <= MAX_SHARDS)?),
        };
        let mut files = IndexMap::new();
        for (rel, e) in get("files")?.dict()? {
            e.dict()?;
            let (dev, ino) = (whole(e.get("dev"))?, whole(e.get("ino"))?);
            let (size, born) = (whole(e.get("size")), optional(e.get("born"))?);
            let node = owned(e);
            let entry = Entry {
                dev,
                ino,
                size,
                born,
                node,
            };
            files.insert(str_name(rel)?, entry);
        }
        let mut pending = Vec::new();
        let empty = object(Vec::new());
        for (rel, claims) in get("pending").unwrap_or(&empty).dict()? {
            let Value::Array(claims) = &claims.value else {
                return None;
            };
            let claim = |c: &Node<'_>| {
                c.dict()?;
                let header = match string(c.get("output_header_sha256"))? {
                    Str::Text(t) => t.to_string(),
                    Str::Wide(_) => return None,
                };
                let (dev, ino) = (whole(c.get("dev"))?, whole(c.get("ino"))?);
                let size = whole(c.get("size"))?;
                let (born, mtime) = (optional(c.get("born"))?, optional(c.get("mtime"))?);
                Some(Claim {
                    dev,
                    ino,
                    size,
                    header,
                    born,
                    mtime,
                })
            };
            pending.push((
                str_name(rel)?,
                claims.iter().map(claim).collect::<Option<_>>()?,
            ));
        }
        let options = get("options")?;
        match string(options.get("to"))? {
            Str::Text(t) => Target::from_name(t.as_ref())?,
            Str::Wide(_) => return None,
        };
        let literal = |k| match get(k).map(|n| &n.value) {
            Some(Value::Literal(l)) => Some(*l),
            _ => None,
        };
        Some(Manifest {
            dst: dst.to_path_buf(),
            name: name.into(),
            src: str_name(string(get("src"))?)?,
            src_id: pair("src_id")?,
            options: owned(options),
            allow_quantized: literal("allow_quantized").and_then(|l| match l {
                "true" => Some(true),
                "false" => Some(false),
                _ => None,
            }),
            shard,
            planned: names("planned")?,
            complete: literal("complete") == Some("true"),
            finalize: literal("finalize") == Some("true"),
            files,
            pending,
            published: None,
            first_replace: None,
            token: String::new(),
            saved: false,
        })
    }
}

/// Every manifest in `dst` (the whole run's and the shards'), and those unreadable.
pub fn load_all(dst: &Path) -> Result<(Vec<Manifest>, Vec<Unreadable>)> {
    let entries = match std::fs::read_dir(dst) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
        Err(e) => return Err(Error::io(dst, "cannot list", e)),
    };
    let mut names = Vec::new();
    for e in entries {
        let name = e.map_err(|e| Error::io(dst, "cannot list", e))?.file_name();
        if is_manifest(name.as_bytes()) {
            // A manifest's name is ASCII (`is_manifest`).
            names.push(name.to_string_lossy().into_owned());
        }
    }
    names.sort();
    let (mut found, mut bad) = (Vec::new(), Vec::new());
    for name in names {
        match Manifest::load(dst, &name) {
            Ok(m) => found.push(m),
            Err(e) => bad.push(e),
        }
    }
    Ok((found, bad))
}

/// The identity of `dst/rel` if a manifest of `manifests` proves stcast wrote it: one
/// records it with that identity, or claims it (the same device, inode and size, and the
/// header claimed).
pub fn proves(manifests: &[Manifest], dst: &Path, rel: &OsStr) -> Result<Option<Ident>> {
    let path = dst.join(rel);
    let Some(meta) = lstat(&path)? else {
        return Ok(None);
    };
    let id = ident(&meta);
    if manifests
        .iter()
        .any(|m| m.entry(rel).is_some_and(|e| e.is(&meta)))
    {
        return Ok(Some(id));
    }
    if !meta.is_file() {
        return Ok(None);
    }
    let mut hash: Option<String> = None;
    for m in manifests {
        for c in m
            .pending
            .iter()
            .filter(|(r, _)| r == rel)
            .flat_map(|(_, c)| c)
        {
            let edited = c.mtime.is_some_and(|t| mtime(&meta) != Some(t));
            if !is(&meta, (c.dev, c.ino), c.born) || c.size != meta.size() || edited {
                continue;
            }
            if c.header.is_empty() {
                return Ok(Some(id));
            }
            if hash.is_none() {
                hash = Some(header_sha256(&path)?);
            }
            if hash.as_deref() == Some(c.header.as_str()) {
                return Ok(Some(id));
            }
        }
    }
    Ok(None)
}

/// The nodes of `entries` that record the file at `dst/rel` as it is now: a regular file of
/// the device, inode and size they give (none when it is gone, or not a regular file).
fn recording<'a>(
    dst: &Path,
    rel: &OsStr,
    entries: impl IntoIterator<Item = &'a Entry>,
) -> Result<Vec<Node<'static>>> {
    let Some(meta) = lstat(&dst.join(rel))?.filter(|m| m.is_file()) else {
        return Ok(Vec::new());
    };
    let same = |e: &&Entry| e.is(&meta) && e.size == Some(meta.size());
    Ok(entries
        .into_iter()
        .filter(same)
        .map(|e| e.node.clone())
        .collect())
}

/// What a run asks of the destination's manifests before it writes anything.
#[derive(Debug, Clone)]
pub struct Asked<'a> {
    pub src_id: Ident,
    pub shard: Option<Shard>,
    /// The options that change the output, as this run records them.
    pub options: &'a Node<'a>,
    pub force: bool,
    pub resume: bool,
}

/// What the destination holds, as far as the manifests tell (`survey`).
#[derive(Debug, Default)]
pub struct Survey {
    /// Every file there but stcast's bookkeeping, listed before the manifests were read.
    pub present: Vec<OsString>,
    /// The identity of what is at this run's manifest name.
    pub at_own_name: Option<Ident>,
    /// This source's manifest at this run's name (an interrupted run's, to replace).
    pub own: Option<Manifest>,
    /// This source's other runs' manifests.
    pub siblings: Vec<Manifest>,
    /// The files a manifest of this source proves stcast wrote: rel -> identity.
    pub ours: Vec<(OsString, Ident)>,
    /// The entries of those files in this source's manifests made with this run's options
    /// that record the file there now (`recording`).
    pub entries: Vec<(OsString, Vec<Node<'static>>)>,
    /// What this source's runs plan to write.
    pub planned: Vec<OsString>,
    /// Under `force`: every file there, as found (rel -> identity).
    pub found: Vec<(OsString, Ident)>,
}

/// Check what `dst` holds before anything is written, as far as manifests tell: refused
/// are an unreadable manifest or another source's (unless `force`), and, unless `force`
/// or `resume`, a stopped run of this one, a whole run into shard runs' folder, and shard
/// runs with other options. Then what the manifests prove stcast wrote.
pub fn survey(dst: &Path, run: &Asked<'_>) -> Result<Survey> {
    let mut survey = Survey::default();
    if !dst.is_dir() {
        return Ok(survey);
    }
    let own_name = file_name(run.shard);
    // The folder first, then the manifests: a rival run writes its manifest (naming what it
    // plans) before each of its files, so every file listed here is in a manifest read
    // after. (The other order takes a file written in between for a foreign one.)
    survey.present = crate::run::walk::listing(dst)?;
    crate::failpoint::hit("folder-listed").map_err(|e| Error::io(dst, "failpoint", e))?;
    survey.at_own_name = lstat(&dst.join(&own_name))?.as_ref().map(ident);
    let (manifests, bad) = load_all(dst)?;
    if let Some(b) = bad.into_iter().next().filter(|_| !run.force) {
        return Err(b.refusal(false));
    }
    let (mine, others): (Vec<_>, Vec<_>) =
        manifests.into_iter().partition(|m| m.src_id == run.src_id);
    if let Some(m) = others.first().filter(|_| !run.force) {
        let src = PathBuf::from(&m.src);
        return Err(refused(
            dst.to_path_buf(),
            ManifestProblem::OtherSource { src },
        ));
    }
    let want = canonical(run.options);
    let same: Vec<&Manifest> = mine
        .iter()
        .filter(|m| canonical(&m.options) == want)
        .collect();
    if !run.force && !run.resume {
        let problem = if mine.iter().any(|m| m.name == own_name) {
            let shard = run.shard.is_some();
            Some(ManifestProblem::Stopped {
                name: own_name.clone(),
                shard,
            })
        } else if run.shard.is_none() && !mine.is_empty() {
            Some(ManifestProblem::ShardRuns)
        } else if same.len() != mine.len() {
            Some(ManifestProblem::OtherOptions)
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(refused(dst.to_path_buf(), problem));
        }
    }
    for rel in &survey.present {
        if let Some(id) = proves(&mine, dst, rel)? {
            survey.ours.push((rel.clone(), id));
            let entries = recording(dst, rel, same.iter().filter_map(|m| m.entry(rel)))?;
            if !entries.is_empty() {
                survey.entries.push((rel.clone(), entries));
            }
        }
    }
    let mut planned: Vec<OsString> = mine
        .iter()
        .flat_map(|m| m.planned.iter().cloned())
        .collect();
    planned.sort();
    planned.dedup();
    survey.planned = planned;
    if run.force {
        for rel in &survey.present {
            if let Some(m) = lstat(&dst.join(rel))? {
                survey.found.push((rel.clone(), ident(&m)));
            }
        }
    }
    let (own, siblings): (Vec<_>, Vec<_>) = mine.into_iter().partition(|m| m.name == own_name);
    survey.own = own.into_iter().next();
    survey.siblings = siblings;
    Ok(survey)
}

/// What `finalize` completes: every manifest of the source, all finished.
#[derive(Debug)]
pub struct Finished {
    pub manifests: Vec<Manifest>,
    /// The options they agree on (`agreed_options`).
    pub options: Node<'static>,
    /// Each file's entries in them that record the file there now (`recording`), in their
    /// order.
    pub entries: Vec<(OsString, Vec<Node<'static>>)>,
}

/// The manifests of the source `src_id` in `dst` that `finalize` completes: refused when
/// there is none, when one cannot be read, or when a run has not finished (it may still
/// write, and completing the folder now would race it).
pub fn finished(dst: &Path, src_id: Ident) -> Result<Finished> {
    if !dst.is_dir() {
        return Err(refused(dst.to_path_buf(), ManifestProblem::NoFolder));
    }
    let (manifests, bad) = load_all(dst)?;
    if let Some(b) = bad.into_iter().next() {
        return Err(b.refusal(true));
    }
    let manifests: Vec<_> = manifests
        .into_iter()
        .filter(|m| m.src_id == src_id)
        .collect();
    if manifests.is_empty() {
        return Err(refused(
            dst.to_path_buf(),
            ManifestProblem::NothingToFinalize,
        ));
    }
    // (An unfinished finalize is not: this one takes over from it.)
    if let Some(m) = manifests.iter().find(|m| !m.complete && !m.finalize) {
        let shard = m.shard;
        return Err(refused(m.path(), ManifestProblem::Unfinished { shard }));
    }
    let options = agreed_options(dst, &manifests)?;
    let mut by_rel: Vec<(OsString, Vec<&Entry>)> = Vec::new();
    for (rel, e) in manifests.iter().flat_map(|m| &m.files) {
        match by_rel.iter_mut().find(|(r, _)| r == rel) {
            Some((_, list)) => list.push(e),
            None => by_rel.push((rel.clone(), vec![e])),
        }
    }
    let mut entries = Vec::with_capacity(by_rel.len());
    for (rel, list) in by_rel {
        let recorded = recording(dst, &rel, list)?;
        entries.push((rel, recorded));
    }
    Ok(Finished {
        manifests,
        options,
        entries,
    })
}

/// The options every manifest was made with (they must all agree), each level's keys
/// sorted; a `max_shard_size` that is no size, or a `name` that is no stem, is refused.
pub fn agreed_options(dst: &Path, manifests: &[Manifest]) -> Result<Node<'static>> {
    let mut seen: Vec<String> = manifests.iter().map(|m| canonical(&m.options)).collect();
    seen.sort();
    seen.dedup();
    let refuse = |problem| Err(refused(dst.to_path_buf(), problem));
    let [_] = seen.as_slice() else {
        return refuse(ManifestProblem::Disagree {
            listed: seen.join(", "),
        });
    };
    let options = sorted(&manifests[0].options);
    if let Some(size) = options.get("max_shard_size") {
        if whole(Some(size)).is_none_or(|s| s == 0) {
            let value = Dump::indented(None).text(size);
            return refuse(ManifestProblem::BadSize { value });
        }
    }
    if let Some(name) = options.get("name") {
        let stem = match string(Some(name)) {
            Some(Str::Text(t)) => crate::naming::is_stem(t),
            _ => false,
        };
        if !stem {
            let value = Dump::indented(None).text(name);
            return refuse(ManifestProblem::BadName { value });
        }
    }
    Ok(options)
}

#[cfg(test)]
mod tests;
