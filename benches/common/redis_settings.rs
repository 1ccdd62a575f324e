//! Redis settings a bench run asks for in an environment variable, as name and value pairs
//! ("zset-max-listpack-entries 16"), for `CONFIG SET` once the servers are up.

/// The pairs in `variable`; none when it is unset. Panics on an odd count of words, naming
/// the variable: a bench run with half a setting measures something else than it says.
pub fn from_env(variable: &str) -> Vec<(String, String)> {
    let text = std::env::var(variable).unwrap_or_default();
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(
        words.len().is_multiple_of(2),
        "{variable} takes name and value pairs, got {text:?}"
    );
    words
        .chunks(2)
        .map(|pair| (pair[0].to_owned(), pair[1].to_owned()))
        .collect()
}
