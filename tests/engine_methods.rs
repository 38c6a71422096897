//! `CudaEngine`'s methods, found from one place: the table by topic in its type's doc comment
//! (`pub struct CudaEngine` in `src/core/engine.rs`) names every public method of every
//! `impl CudaEngine` block under `src/`, once, as an intra-doc link
//! ``[`name`](CudaEngine::name)`` with a line saying what it is for, and names nothing else.
//!
//! The methods live in the files of the levels that own their state (about fifteen files), so
//! this test reads the sources: it blanks out comments and string and character literals,
//! finds every `impl CudaEngine { … }` block by its braces, and collects the `pub fn` items at
//! the block's top level (`pub(crate)` and narrower are not public; `impl … for CudaEngine`
//! blocks are trait implementations, not methods of the table). The checker itself is tested
//! on small made-up sources below, so a change that blinds it fails here too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `src` with every comment and every string and character literal replaced by spaces
/// (newlines kept), so braces and keywords in them are not read as code.
fn blank_non_code(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            let end = b[i..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(b.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if b[i..].starts_with(b"/*") {
            // Block comments nest in Rust.
            let (mut depth, mut j) = (0usize, i);
            while j < b.len() {
                if b[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if b[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if b[i] == b'r' && raw_string_start(b, i) {
            // A raw string: r"…", r#"…"#, …
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let start = i + 2 + hashes;
            let end = b[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| start + p + close.len());
            blank(&mut out, i, end);
            i = end;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            blank(&mut out, i, (j + 1).min(b.len()));
            i = j + 1;
        } else if b[i] == b'\'' {
            // A character literal ('x', '\n', '\u{..}', '{'), not a lifetime ('a).
            let end = if b.get(i + 1) == Some(&b'\\') {
                // Past the escaped character (which may itself be a quote: '\'').
                b.get(i + 3..)
                    .and_then(|tail| tail.iter().position(|&c| c == b'\''))
                    .map(|p| i + 4 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 3)
            } else {
                None
            };
            match end {
                Some(end) => {
                    blank(&mut out, i, end);
                    i = end;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8(out).expect("blanking keeps the text UTF-8 (only ASCII bytes change)")
}

/// Whether the `r` at `i` opens a raw string (`r"`, `r#"`, `br"`, …), not ends an identifier.
fn raw_string_start(b: &[u8], i: usize) -> bool {
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let starts_word = match i {
        0 => true,
        _ if !ident(b[i - 1]) => true,
        1 => b[0] == b'b',
        _ => b[i - 1] == b'b' && !ident(b[i - 2]),
    };
    let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
    starts_word && b.get(i + 1 + hashes) == Some(&b'"')
}

/// The identifier-like words of `code` (already blanked), with their byte offsets; every other
/// non-space byte (`{`, `}`, `(`, `:`, …) is a word of its own.
fn words(code: &str) -> Vec<(usize, &str)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((start, &code[start..i]));
        } else {
            let len = code[i..].chars().next().map_or(1, char::len_utf8);
            out.push((i, &code[i..i + len]));
            i += len;
        }
    }
    out
}

/// The public methods of every `impl CudaEngine { … }` block of `src` (one file's text): the
/// names of the `pub fn` items at each block's top level, in order.
fn public_methods(src: &str) -> Vec<String> {
    let code = blank_non_code(src);
    let w = words(&code);
    let mut found = Vec::new();
    let mut k = 0;
    while k < w.len() {
        // `impl CudaEngine {` or `impl crate::CudaEngine {` (a path ending in `CudaEngine`).
        if w[k].1 != "impl" {
            k += 1;
            continue;
        }
        let mut j = k + 1;
        while j + 2 < w.len() && w[j].1 != "CudaEngine" && matches!(w[j + 1].1, ":") {
            j += 3; // `segment` `:` `:`
        }
        if w.get(j).map(|x| x.1) != Some("CudaEngine") || w.get(j + 1).map(|x| x.1) != Some("{") {
            k += 1;
            continue;
        }
        // Walk the block; items at depth 1 are its members.
        let mut depth = 0usize;
        let mut m = j + 1;
        while m < w.len() {
            match w[m].1 {
                "{" => depth += 1,
                "}" => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                "pub" if depth == 1 => {
                    let mut n = m + 1;
                    while matches!(w.get(n).map(|x| x.1), Some("async" | "unsafe" | "const")) {
                        n += 1;
                    }
                    if w.get(n).map(|x| x.1) == Some("fn")
                        && let Some(&(_, name)) = w.get(n + 1)
                    {
                        found.push(name.to_string());
                    }
                }
                _ => {}
            }
            m += 1;
        }
        k = m;
    }
    found
}

/// Every ``[`name`](CudaEngine::target)`` link in the table rows (`/// | …` lines) of the doc
/// comment right above `pub struct CudaEngine` in `src`, as `(name, target, row)`.
fn table_links(src: &str) -> Result<Vec<(String, String, String)>, String> {
    let lines: Vec<&str> = src.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("pub struct CudaEngine"))
        .ok_or("no `pub struct CudaEngine` line")?;
    let mut doc = Vec::new();
    for l in lines[..at].iter().rev() {
        let t = l.trim_start();
        if t.starts_with("///") {
            doc.push(t);
        } else if t.starts_with("#[") {
            continue;
        } else {
            break;
        }
    }
    doc.reverse();
    let mut links = Vec::new();
    for row in doc.iter().filter(|l| l.starts_with("/// |")) {
        let mut rest = *row;
        while let Some(start) = rest.find("[`") {
            rest = &rest[start + 2..];
            let Some(end) = rest.find("`](") else { break };
            let name = rest[..end].to_string();
            rest = &rest[end + 3..];
            let Some(close) = rest.find(')') else { break };
            let target = &rest[..close];
            rest = &rest[close..];
            if let Some(target) = target.strip_prefix("CudaEngine::") {
                links.push((name, target.to_string(), row.to_string()));
            }
        }
    }
    Ok(links)
}

/// What is wrong with the table against the methods (`name -> file`), one line each.
fn table_problems(
    links: &[(String, String, String)],
    methods: &BTreeMap<String, Vec<PathBuf>>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, target, row) in links {
        if name != target {
            problems.push(format!(
                "the link [`{name}`] points to CudaEngine::{target}"
            ));
        }
        if !methods.contains_key(target) {
            problems.push(format!(
                "the table names CudaEngine::{target}, which is no public method of an `impl CudaEngine` block"
            ));
        }
        // The row says what the method is for: text after its last link.
        let after = row
            .rfind("](CudaEngine::")
            .and_then(|at| row[at..].find(')').map(|close| &row[at + close + 1..]))
            .unwrap_or("");
        if after.trim().trim_matches('|').trim().is_empty() {
            problems.push(format!(
                "the row of CudaEngine::{target} says nothing: {row}"
            ));
        }
        *seen.entry(target).or_default() += 1;
    }
    for (name, files) in methods {
        match seen.get(name.as_str()) {
            None => problems.push(format!(
                "CudaEngine::{name} (in {}) is missing from the table",
                files
                    .iter()
                    .map(|f| f.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Some(&n) if n > 1 => {
                problems.push(format!("CudaEngine::{name} is in the table {n} times"))
            }
            _ => {}
        }
    }
    problems
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_engine_type_doc_lists_every_public_method_once() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();
    let mut methods: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for file in &files {
        let src = std::fs::read_to_string(file).expect("a readable source file");
        for name in public_methods(&src) {
            let rel = file.strip_prefix(root).unwrap_or(file).to_path_buf();
            methods.entry(name).or_default().push(rel);
        }
    }
    assert!(
        methods.len() >= 40 && methods.contains_key("flush") && methods.contains_key("prepare"),
        "the checker found too few methods: {methods:?}"
    );
    let engine = std::fs::read_to_string(root.join("src/core/engine.rs")).expect("engine.rs");
    let links = table_links(&engine).expect("the engine's type doc");
    let problems = table_problems(&links, &methods);
    assert!(
        problems.is_empty(),
        "the method table of CudaEngine's type doc (src/core/engine.rs) disagrees with the code:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_checker_finds_public_methods_and_nothing_in_comments_strings_or_other_impls() {
    let src = r####"
/// impl CudaEngine { pub fn in_a_doc() {} }
impl CudaEngine {
    /// ```
    /// pub fn in_an_example() { }
    /// ```
    pub fn first(&mut self) -> Result<()> {
        let s = "{ pub fn in_a_string() {";
        let c = '{';
        let r = r#"} pub fn in_a_raw_string() }"#;
        fn inner() {}
        /* pub fn in_a_block_comment() { /* nested } */ } */
        Ok(())
    }
    pub(crate) fn not_public(&self) {}
    #[cfg(feature = "sim")]
    pub unsafe fn second<'a>(&'a self) -> &'a str { "}" }
    pub async fn third(&self) {}
    pub const X: usize = 1;
}
impl Drop for CudaEngine {
    fn drop(&mut self) {}
}
impl std::fmt::Debug for CudaEngine { pub fn not_a_method() {} }
impl crate::CudaEngine {
    pub fn fourth(&self) {}
}
impl Other {
    pub fn elsewhere(&self) {}
}
"####;
    assert_eq!(public_methods(src), ["first", "second", "third", "fourth"]);

    let doc = "/// The engine.\n///\n/// | topic | method | what for |\n/// | --- | --- | --- |\n\
               /// | open | [`first`](CudaEngine::first) | opens |\n\
               /// | | [`second`](CudaEngine::second) | |\n\
               /// | | [`gone`](CudaEngine::gone) | a method that is not there |\n\
               /// | | [`third`](CudaEngine::fourth) | misnamed |\n\
               /// | | [`first`](CudaEngine::first) | again |\n\
               /// Not a row: [`x`](CudaEngine::x).\n#[derive(Debug)]\npub struct CudaEngine {}\n";
    let links = table_links(doc).unwrap();
    assert_eq!(links.len(), 5);
    let methods: BTreeMap<String, Vec<PathBuf>> = ["first", "second", "third", "fourth"]
        .iter()
        .map(|m| (m.to_string(), vec![PathBuf::from("src/x.rs")]))
        .collect();
    let problems = table_problems(&links, &methods).join("\n");
    for expected in [
        "CudaEngine::gone, which is no public method",
        "the link [`third`] points to CudaEngine::fourth",
        "CudaEngine::first is in the table 2 times",
        "CudaEngine::third (in src/x.rs) is missing",
        "the row of CudaEngine::second says nothing",
    ] {
        assert!(problems.contains(expected), "{expected}: {problems}");
    }
    assert!(!problems.contains("CudaEngine::x"), "{problems}");
    assert!(table_links("no engine here").is_err());
}
