//! The manual stays true to the binary: the README stays a front door, every relative link in the
//! README, `ARCHITECTURE.md` and `docs/` leads to a file (and heading) that exists, every flag the
//! binary's `--help` prints is in the operations page, and every variable of the reference server
//! that slidegate reads or names is in the migration page.
// Tests may panic on a broken set-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const README_MAX_LINES: usize = 400;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The Markdown files the manual is made of.
fn manual() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "docs/ holds no page");
    files.extend(pages);
    files
}

/// Text outside fenced code blocks, line by line.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces as
/// `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .into_iter()
        .filter_map(|line| {
            let title = line.trim_start_matches('#');
            (line.starts_with('#') && title.starts_with(' ')).then(|| slug(title))
        })
        .collect()
}

/// Every `[text](target)` of a line, the target as written.
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(after[..end].to_string());
        rest = &after[end..];
    }
    targets
}

#[test]
fn the_readme_is_a_front_door() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines; at most {README_MAX_LINES}: move reference material to docs/"
    );
    for page in manual().iter().skip(2) {
        let name = page
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .to_string();
        assert!(
            readme.contains(&format!("]({name})")),
            "README.md's map of docs/ does not link {name}"
        );
    }
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in manual() {
        let text = read(&file);
        for (number, line) in text.lines().enumerate() {
            if prose(line).is_empty() {
                continue;
            }
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                let place = format!("{}:{}: {target}", file.display(), number + 1);
                if !resolved.exists() {
                    broken.push(format!("{place}: no such file"));
                } else if !anchor.is_empty() && !anchors(&read(&resolved)).contains(anchor) {
                    broken.push(format!("{place}: no heading with that anchor"));
                }
            }
        }
    }
    assert!(checked > 20, "only {checked} relative links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_flag_of_help_is_in_the_operations_page() {
    let output = Command::new(env!("CARGO_BIN_EXE_slidegate"))
        .arg("--help")
        .output()
        .expect("run slidegate --help");
    assert!(output.status.success(), "slidegate --help failed");
    let help = String::from_utf8(output.stdout).unwrap();
    let flags: BTreeSet<String> = help
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|word| word.starts_with("--") && word.len() > 2)
        .map(str::to_string)
        .collect();
    assert!(flags.len() > 40, "only {} flags in --help", flags.len());
    let page = read(&root().join("docs/operations.md"));
    let missing: Vec<&String> = flags
        .iter()
        .filter(|flag| !["--help", "--version"].contains(&flag.as_str()))
        .filter(|flag| !page.contains(&format!("`{flag}")))
        .collect();
    assert!(
        missing.is_empty(),
        "flags of --help missing from docs/operations.md: {missing:?}"
    );
}

#[test]
fn every_reference_variable_is_in_the_migration_page() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("src/cli/reference_env"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    let source: String = files.iter().map(|path| read(path)).collect();
    // Every upper-case string literal with an underscore or of a bare listener name: the
    // variables the reference server's environment modules read, warn about or refuse.
    let names: BTreeSet<&str> = source
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|word| {
            word.len() > 2
                && word
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                && (word.contains('_') || ["HOST", "PORT", "PROTO"].contains(word))
        })
        .collect();
    assert!(names.len() > 80, "only {} variables found", names.len());
    let page = read(&root().join("docs/migrating.md"));
    let words: BTreeSet<&str> = page
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    let missing: Vec<&&str> = names
        .iter()
        .filter(|name| !words.contains(**name))
        .collect();
    assert!(
        missing.is_empty(),
        "variables of src/cli/reference_env/ missing from docs/migrating.md: {missing:?}"
    );
}

#[test]
fn slugs_follow_github() {
    assert_eq!(
        slug(" The reference server's environment"),
        "the-reference-servers-environment"
    );
    assert_eq!(slug(" Envoy (`deploy/envoy/`)"), "envoy-deployenvoy");
    assert_eq!(
        link_targets("see [a](b.md#c) and [d](e.md)"),
        ["b.md#c", "e.md"]
    );
}
