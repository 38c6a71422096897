//! Renders the guide's chapters (`docs/guide/*.md`) for rustdoc, so that one Markdown source
//! links correctly both where it is read on the repository and in the crate's documentation.
//!
//! In the chapters a link to another chapter is a relative file link, `[the rules](rules.md#x)`,
//! which the repository's viewer resolves; rustdoc would leave it as a relative URL that names no
//! page. Here it becomes the intra-doc link `crate::guide::rules#x`, which rustdoc resolves (and
//! `-D warnings` checks). A link to a record, `[the figures](../records/x.md)`, has no page in the
//! documentation, so it becomes the record's path as text. Links to items (`crate::CudaEngine`)
//! and URLs are left as they are. `src/guide.rs` includes the rendered chapters, and its tests
//! check that every relative link and anchor resolves on the repository.

use std::path::Path;
use std::{env, fs};

fn main() {
    let guide = Path::new("docs/guide");
    println!("cargo::rerun-if-changed={}", guide.display());
    let out = Path::new(&env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("guide");
    fs::create_dir_all(&out).expect("OUT_DIR is writable");
    let mut chapters: Vec<_> = fs::read_dir(guide)
        .expect("docs/guide is in the package")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    chapters.sort();
    for chapter in chapters {
        println!("cargo::rerun-if-changed={}", chapter.display());
        let text = fs::read_to_string(&chapter).expect("a chapter is UTF-8 text");
        let name = chapter.file_name().expect("a file name");
        fs::write(out.join(name), render(&text)).expect("OUT_DIR is writable");
    }
}

/// The chapter with each relative link rewritten for rustdoc; fenced code is copied unchanged.
fn render(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fenced = false;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || line.trim_start().starts_with("```") {
            out.push_str(line);
        } else {
            out.push_str(&render_line(line));
        }
    }
    out
}

fn render_line(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let (before, after) = rest.split_at(at);
        let target_len = after[2..].find(')').unwrap_or(after.len() - 2);
        let target = &after[2..2 + target_len];
        let tail = &after[(2 + target_len + 1).min(after.len())..];
        if let Some(record) = target.strip_prefix("../records/") {
            // `[text](../records/x.md)` becomes `text (docs/records/x.md)`.
            // A link whose text is the file's name is the path alone.
            let open = link_text_start(before);
            let text = &before[open + 1..];
            out.push_str(&before[..open]);
            if text.trim_matches('`') != record.split('#').next().unwrap_or(record) {
                out.push_str(text);
                out.push(' ');
                out.push('(');
            }
            out.push_str(&format!("`docs/records/{record}`"));
            if text.trim_matches('`') != record.split('#').next().unwrap_or(record) {
                out.push(')');
            }
        } else if let Some(path) = chapter_path(target) {
            out.push_str(before);
            out.push_str("](");
            out.push_str(&path);
            out.push(')');
        } else {
            out.push_str(before);
            out.push_str(&after[..(2 + target_len + 1).min(after.len())]);
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// Where the `[` that opens the link text ending at `before`'s end is.
fn link_text_start(before: &str) -> usize {
    let mut depth = 0usize;
    for (at, c) in before.char_indices().rev() {
        match c {
            ']' => depth += 1,
            '[' if depth == 0 => return at,
            '[' => depth -= 1,
            _ => {}
        }
    }
    0
}

/// `rules.md#x` as `crate::guide::rules#x`, `README.md` as `crate::guide`; `None` for a target
/// that is not a chapter of the guide.
fn chapter_path(target: &str) -> Option<String> {
    let (file, anchor) = target
        .split_once('#')
        .map_or((target, None), |(f, a)| (f, Some(a)));
    let stem = file.strip_suffix(".md")?;
    if stem.is_empty() || stem.contains(['/', ':']) {
        return None;
    }
    let mut path = match stem {
        "README" => "crate::guide".to_string(),
        _ => format!("crate::guide::{}", stem.replace('-', "_")),
    };
    if let Some(anchor) = anchor {
        path.push('#');
        path.push_str(anchor);
    }
    Some(path)
}
