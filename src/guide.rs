// The user guide: the Markdown chapters of `docs/guide/`, rendered as documentation and run as
// doctests, so every snippet in the guide compiles and runs against the current API. Each chapter
// is included as `build.rs` renders it: the links between chapters are relative file links in
// the Markdown (`rules.md#anchor`, which resolve on the repository) and intra-doc links here
// (`crate::guide::rules#anchor`); the tests below check the repository's side.
#![doc = include_str!(concat!(env!("OUT_DIR"), "/guide/README.md"))]

/// One chapter of `docs/guide/`, as `build.rs` renders it for rustdoc.
macro_rules! chapter {
    ($file:literal) => {
        include_str!(concat!(env!("OUT_DIR"), "/guide/", $file))
    };
}

pub mod engine {
    // Opening an engine, ownership, Drop rules and the simulated device.
    #![doc = chapter!("engine.md")]
}

pub mod flush_and_synchronize {
    // The submission boundary, the host barrier and every place the host waits.
    #![doc = chapter!("flush-and-synchronize.md")]
}

pub mod transfers {
    // The blocking and pending routes, pinned buffers, staging settings and which route to use.
    #![doc = chapter!("transfers.md")]
}

#[cfg(feature = "safetensors")]
pub mod checkpoints {
    // Loading and saving safetensors checkpoints through pinned staging.
    #![doc = chapter!("checkpoints.md")]
}

pub mod across_processes {
    // Ranks in processes of their own: launch, rendezvous, join, collectives, deadlines, and
    // what happens when a peer dies.
    #![doc = chapter!("across-processes.md")]
}

#[cfg(target_os = "linux")]
pub mod sharing {
    // Device tensors shared between processes: the mechanism, the two sides, the order across
    // processes, the lifetimes, and what is refused.
    #![doc = chapter!("sharing.md")]
}

#[cfg(feature = "dlpack")]
pub mod interop {
    // Tensors to and from other libraries: DLPack both ways, cudarc, and the Python module.
    #![doc = chapter!("interop.md")]
}

pub mod kernels {
    // The elementwise kernels: which element types each serves, and their semantics.
    #![doc = chapter!("kernels.md")]
}

pub mod api {
    // The rule every public item follows, the modules, and what was renamed (the "Moving" table).
    #![doc = chapter!("api.md")]
}

pub mod prepared_graphs {
    // Tracing, compiling, preparing and running programs; borrowed outputs and the rules.
    #![doc = chapter!("prepared-graphs.md")]
}

pub mod lifecycles {
    // The lifecycle types and the misuse they rule out, as compile-fail doctests.
    #![doc = chapter!("lifecycles.md")]
}

pub mod rules {
    // The invariants every operation keeps.
    #![doc = chapter!("rules.md")]
}

pub mod unsupported {
    // What is refused, and the typed error each refusal returns.
    #![doc = chapter!("unsupported.md")]
}

// The README's quick start, compiled as a doctest (the README is the repository's front page,
// not a chapter, so it is not rendered).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct Readme;

#[cfg(test)]
mod tests {
    //! The guide's links resolve when read on the repository: every relative link of the README,
    //! the guide's chapters and the records' summary names a file that exists, and every anchor
    //! a heading of its page. (Rustdoc checks the other side, with `-D warnings`.)

    use std::path::{Path, PathBuf};

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    /// The pages whose links are checked, relative to the repository root.
    fn pages() -> Vec<PathBuf> {
        let mut pages = vec![
            PathBuf::from("README.md"),
            PathBuf::from("docs/records/README.md"),
        ];
        let mut chapters: Vec<PathBuf> = std::fs::read_dir(root().join("docs/guide"))
            .expect("docs/guide is readable")
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
            .map(|path| {
                path.strip_prefix(root())
                    .expect("under the root")
                    .to_path_buf()
            })
            .collect();
        chapters.sort();
        pages.extend(chapters);
        pages
    }

    /// The page's text outside fenced code blocks and code spans.
    fn prose(text: &str) -> String {
        let mut out = String::new();
        let mut fenced = false;
        for line in text.lines() {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if fenced {
                continue;
            }
            let mut in_span = false;
            for c in line.chars() {
                if c == '`' {
                    in_span = !in_span;
                    out.push('`');
                } else if !in_span {
                    out.push(c);
                }
            }
            out.push('\n');
        }
        out
    }

    /// Every link target of a page: inline links `](target)` and definitions `[label]: target`.
    fn targets(text: &str) -> Vec<String> {
        let prose = prose(text);
        let mut found = Vec::new();
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find([')', ' ']).unwrap_or(rest.len());
            found.push(rest[..end].to_string());
        }
        for line in prose.lines() {
            let line = line.trim_start();
            if let Some(close) = line.strip_prefix('[').and_then(|l| l.find("]: ")) {
                let target = line[close + 4..].split_whitespace().next().unwrap_or("");
                found.push(target.to_string());
            }
        }
        found
    }

    /// GitHub's anchor for a heading: lower case, spaces to hyphens, other punctuation dropped.
    fn slug(heading: &str) -> String {
        heading
            .trim()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                '-' | '_' => Some(c),
                c if c.is_alphanumeric() => Some(c.to_ascii_lowercase()),
                _ => None,
            })
            .collect()
    }

    fn anchors(page: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(page).unwrap_or_default();
        let mut fenced = false;
        let mut anchors = Vec::new();
        for line in text.lines() {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
            } else if !fenced && line.starts_with('#') {
                anchors.push(slug(line.trim_start_matches('#')));
            }
        }
        anchors
    }

    #[test]
    fn guide_links_resolve_on_the_repository() {
        let mut broken = Vec::new();
        for page in pages() {
            let text = std::fs::read_to_string(root().join(&page)).expect("the page is readable");
            let dir = page.parent().expect("a page is in a folder").to_path_buf();
            for target in targets(&text) {
                if target.contains("crate::guide") {
                    broken.push(format!(
                        "{}: `{target}` is a rustdoc path to a chapter: write it as the \
                         chapter's file (`engine.md#anchor`), which resolves in both",
                        page.display()
                    ));
                    continue;
                }
                let scheme = target.split_once(':').is_some_and(|(s, _)| {
                    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '+')
                });
                if target.is_empty() || scheme || target.contains("::") {
                    continue;
                }
                let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let file = if file.is_empty() {
                    root().join(&page)
                } else {
                    root().join(&dir).join(file)
                };
                if !file.exists() {
                    broken.push(format!("{}: `{target}` names no file", page.display()));
                } else if !anchor.is_empty() && !anchors(&file).iter().any(|a| a == anchor) {
                    broken.push(format!("{}: `{target}` names no heading", page.display()));
                }
            }
        }
        assert!(
            broken.is_empty(),
            "links that do not resolve on the repository:\n{}",
            broken.join("\n")
        );
    }
}
