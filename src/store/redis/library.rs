//! The library as Redis runs it: a function library (`FUNCTION LOAD`, called with `FCALL`), or,
//! where `FUNCTION LOAD` is refused (an ACL without it, a proxy or a managed Redis that blocks
//! it), the same code as a script (`SCRIPT LOAD`, called with `EVALSHA`).
//!
//! A function is made once, when its library loads; a script sent with `EVALSHA` makes every one
//! of its functions again on every call, more than doubling a lone call's cost in Redis
//! (`docs/performance.md`). Library and functions are named after the library's version, the
//! first 16 hex digits of its SHA-1, so that two versions side by side (a rolling upgrade) each
//! call their own and never replace the other's.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fred::bytes_utils::Str;
use fred::prelude::*;
use fred::types::config::Options;
use fred::types::scripts::Script;
use fred::types::{ClusterHash, CustomCommand};

use super::SCRIPT;

/// How `lua/` names the library and its functions; replaced with the version's name.
const NAME_IN_SOURCE: &str = "slidegate_VERSION";

/// A function of the library besides the decision ([`Library::call`]): each registered on one
/// line of `lua/register.lua`, with its contract at its definition (`lua/undo_inspect_reset.lua`,
/// `lua/quota.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Function {
    /// Takes back the entry of a rejected request spread over several masters.
    Undo,
    /// Reads one descriptor's keys and writes nothing (`no-writes`: `FCALL_RO`).
    Inspect,
    /// Deletes descriptors' keys (`allow-oom`).
    Reset,
    /// Records Envoys' usage reports and shares each bucket's limit among them.
    Quota,
}

impl Function {
    const ALL: [Function; 4] = [
        Function::Undo,
        Function::Inspect,
        Function::Reset,
        Function::Quota,
    ];

    /// The function's name after the library's, and its entry in the Lua text.
    fn suffix_and_entry(self) -> (&'static str, &'static str) {
        match self {
            Function::Undo => ("_undo", "undo_call"),
            Function::Inspect => ("_inspect", "inspect_call"),
            Function::Reset => ("_reset", "reset_call"),
            Function::Quota => ("_quota", "quota_call"),
        }
    }

    /// The script form's flags, as the function's registration declares them.
    fn script_flags(self) -> &'static str {
        match self {
            Function::Undo | Function::Quota => "",
            Function::Inspect => " flags=no-writes",
            Function::Reset => " flags=allow-oom",
        }
    }
}

/// One of [`Function`] as Redis is asked to run it.
#[derive(Clone, Debug)]
struct Named {
    /// Its name, for `FCALL` (or `FCALL_RO`).
    name: Str,
    /// The same code as a script that runs it, for `EVAL` where functions are refused.
    script_code: Str,
}

#[derive(Clone, Debug)]
pub struct Library {
    /// The function to `FCALL`.
    pub function: Str,
    /// The same for a call whose keys sit in several slots of one cluster master, passed after
    /// their number in `ARGV` with one of them declared (see the script's end).
    pub spread: Str,
    /// The library, for `FUNCTION LOAD`.
    pub code: Str,
    /// The same code as a script that decides when run, for `EVAL` (where functions are refused).
    pub script_code: Str,
    /// That script, for `EVALSHA`.
    script: Script,
    /// The other functions, in the order of [`Function::ALL`].
    others: [Named; 4],
    /// Set when `FUNCTION LOAD` was refused: calls go by `EVALSHA` from then on.
    by_script: Arc<AtomicBool>,
}

impl Library {
    /// slidegate's library.
    pub fn new() -> Library {
        Library::from_source(SCRIPT)
    }

    /// A library from a text written like the joined `lua/` parts (library and functions named
    /// `slidegate_VERSION...`, each registered on one line at the end): for measuring another
    /// version beside this one.
    pub fn from_source(source: &str) -> Library {
        let sha1 = fred::util::sha1_hash(source);
        let name = format!("slidegate_{}", &sha1[..16]);
        let script_code = as_script(source, "decide_call", "");
        let others = Function::ALL.map(|function| {
            let (suffix, entry) = function.suffix_and_entry();
            Named {
                name: format!("{name}{suffix}").into(),
                script_code: as_script(source, entry, function.script_flags()).into(),
            }
        });
        Library {
            code: source.replace(NAME_IN_SOURCE, &name).into(),
            spread: format!("{name}_spread").into(),
            function: name.into(),
            script: Script::from_lua(script_code.clone()),
            script_code: script_code.into(),
            others,
            by_script: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The name `function` has in Redis (for `FCALL`).
    pub fn name(&self, function: Function) -> &str {
        &self.named(function).name
    }

    fn named(&self, function: Function) -> &Named {
        let i = Function::ALL
            .iter()
            .position(|f| *f == function)
            .unwrap_or_default();
        &self.others[i]
    }

    /// Whether calls go by `EVALSHA` (`FUNCTION LOAD` was refused).
    pub fn by_script(&self) -> bool {
        self.by_script.load(Ordering::Relaxed)
    }

    /// Whether a call may carry keys of several slots of one cluster master: only as a
    /// function (a script sent by `EVALSHA` is refused undeclared keys of other slots).
    pub fn spreads(&self) -> bool {
        !self.by_script()
    }

    /// Loads the library on every primary, replacing one of the same name (the same code); where
    /// `FUNCTION LOAD` is refused, loads the script instead. `timeout` bounds each command:
    /// Redis compiles the library, a few milliseconds alone and many more on a busy machine, so
    /// the client's default (the deadline of a decision) would fail a start-up or a reload that
    /// only had to wait, and a load given up on keeps Redis compiling anyway.
    pub async fn load(&self, client: &Client, timeout: Duration) -> Result<(), Error> {
        let client = client.with_options(&Options {
            timeout: Some(timeout),
            ..Options::default()
        });
        match client
            .function_load_cluster::<Value, _>(true, self.code.clone())
            .await
        {
            Ok(_) => {
                self.by_script.store(false, Ordering::Relaxed);
                Ok(())
            }
            Err(e) if refused(&e) => {
                if !self.by_script.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e.details(), "FUNCTION LOAD refused: the script goes by EVALSHA (slower on a lone call)");
                }
                client
                    .script_load_cluster::<(), _>(self.script_code.clone())
                    .await
            }
            Err(e) => Err(e),
        }
    }

    /// One call of the function (or the script). Boxed: the client's future for a call is
    /// about 7 KB, and unboxed it would be part of (and copied with) every decision's future,
    /// queued requests' too; boxed it is made once per call, however many requests it carries.
    pub fn call<'a>(
        &'a self,
        client: &'a Client,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Pin<Box<dyn Future<Output = Result<Value, Error>> + Send + 'a>> {
        self.call_as(client, None, None, keys, args, false)
    }

    /// [`Library::call`], by the spread function when `spread` (`args` then holds the keys
    /// first, after their number, and `keys` none: see the script's end), sent to `node` where
    /// given (a cluster master) and waiting at most `wait`.
    pub fn call_as<'a>(
        &'a self,
        client: &'a Client,
        node: Option<&Server>,
        wait: Option<Duration>,
        keys: Vec<Key>,
        args: Vec<Value>,
        spread: bool,
    ) -> Pin<Box<dyn Future<Output = Result<Value, Error>> + Send + 'a>> {
        if self.by_script() && !spread {
            // The client takes no options for `EVALSHA`: a call by script waits
            // `--redis-timeout` whatever its callers' deadlines.
            return Box::pin(self.script.evalsha(client, keys, args));
        }
        let function = if spread {
            self.spread.clone()
        } else {
            self.function.clone()
        };
        if wait.is_none() && node.is_none() && !client.is_clustered() {
            return Box::pin(client.fcall(function, keys, args));
        }
        // The client's own timeout, not a timer around the call: it also marks the command
        // given up, so that it is never sent after a reconnection (`RedisStore::checked`). On a
        // cluster the client follows no redirection: following `ASK`, it sends `ASKING` and
        // reads the next reply on that connection as its answer, which is another call's
        // while calls are pipelined (the call whose reply it took is then answered `OK`, and a
        // repeated `ASKING` shifts every later reply by one). The caller finds where the keys
        // went (`RedisStore::call_group`).
        let client = client.with_options(&Options {
            timeout: wait,
            cluster_node: node.cloned(),
            max_redirections: client.is_clustered().then_some(0),
            ..Options::default()
        });
        Box::pin(async move { client.fcall(function, keys, args).await })
    }

    /// Whether a call failed because Redis does not have the function or script (a restart
    /// without persistence, `FUNCTION FLUSH`, a node that never saw it): load it and call again.
    pub fn missing(e: &Error) -> bool {
        e.details().contains("Function not found") || e.details().starts_with("NOSCRIPT")
    }

    /// Runs `function` on `key_slot`'s keys by `client` (whose options, such as a timeout,
    /// apply): `FCALL`, `FCALL_RO` for the read-only inspection, or, where `FUNCTION LOAD` is
    /// refused, `EVAL` of its script form (rare calls: Redis keeps the script it compiled). A
    /// function Redis no longer has is loaded by `loader` (the client, and how long the load
    /// may take) and run again, once.
    pub async fn run<C: ClientLike>(
        &self,
        client: &C,
        loader: (&Client, Duration),
        function: Function,
        key_slot: u16,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Value, Error> {
        let named = self.named(function);
        let mut loaded = false;
        loop {
            let (command, first) = match (self.by_script(), function) {
                (true, _) => ("EVAL", named.script_code.clone()),
                (false, Function::Inspect) => ("FCALL_RO", named.name.clone()),
                (false, _) => ("FCALL", named.name.clone()),
            };
            let command = CustomCommand::new_static(command, ClusterHash::Custom(key_slot), false);
            let mut argv: Vec<Value> = Vec::with_capacity(2 + keys.len() + args.len());
            argv.push(first.into());
            argv.push(i64::try_from(keys.len()).unwrap_or(i64::MAX).into());
            argv.extend(keys.iter().cloned().map(Value::from));
            argv.extend(args.iter().cloned());
            match client.custom(command, argv).await {
                Err(e) if Library::missing(&e) && !loaded => {
                    loaded = true;
                    self.load(loader.0, loader.1).await?;
                }
                result => return result,
            }
        }
    }
}

impl Default for Library {
    fn default() -> Self {
        Library::new()
    }
}

/// `FUNCTION LOAD` refused: the command or its subcommand is unknown (renamed away, an older or
/// a compatible server) or not permitted to this user.
fn refused(e: &Error) -> bool {
    let details = e.details().to_ascii_lowercase();
    details.starts_with("noperm")
        || details.contains("unknown command")
        || details.contains("unknown subcommand")
}

/// The parts the decision's script form leaves out: a script makes every function of its text
/// again on every call, and the decision needs none of theirs.
const NOT_FOR_DECIDING: [&str; 2] = ["undo_inspect_reset", "quota"];

/// The library's text as a script that runs `entry` (an entry function) when run, with `flags`
/// on its first line: no library name there, every registration (one line each, at the end) a
/// comment, and the call of `entry` after them; for the decision, without the parts it does not
/// use (each part starts at the line `build.rs` names it by). (In a script `KEYS` and `ARGV`
/// are globals; the library declares locals of those names, hence `_G`.)
fn as_script(source: &str, entry: &str, flags: &str) -> String {
    let source = source.replacen(
        &format!("#!lua name={NAME_IN_SOURCE}"),
        &format!("#!lua{flags}"),
        1,
    );
    let mut left_out = false;
    let mut script: Vec<&str> = source
        .lines()
        .map(|line| {
            if let Some(part) = line
                .strip_prefix("-- lua/")
                .and_then(|p| p.strip_suffix(".lua"))
            {
                left_out = entry == "decide_call" && NOT_FOR_DECIDING.contains(&part);
            }
            if line.starts_with("redis.register_function") {
                "-- (a script registers no function)"
            } else if left_out {
                "--"
            } else {
                line
            }
        })
        .collect();
    let call = format!("return {entry}(_G.KEYS, _G.ARGV)");
    script.push(&call);
    script.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_named_after_the_script_version() {
        let library = Library::new();
        let name: &str = &library.function;
        let version = name.strip_prefix("slidegate_").expect("slidegate_ prefix");
        assert_eq!(version.len(), 16);
        assert!(version.chars().all(|c| c.is_ascii_hexdigit()), "{name}");
        let code: &str = &library.code;
        assert!(code.starts_with(&format!("#!lua name={name}\n")));
        assert!(code.contains(&format!("redis.register_function('{name}'")));
        assert!(!code.contains(NAME_IN_SOURCE));
        // Another version of the script, another name: the two never replace each other.
        let other = Library::from_source(&format!("{SCRIPT}\n-- another version\n"));
        assert_ne!(other.function, library.function);
    }

    #[test]
    fn function_load_refusals_are_told_from_failures() {
        let error = |text: &str| Error::new(ErrorKind::Unknown, text.to_string());
        for refusal in [
            "NOPERM User limited has no permissions to run the 'function|load' command",
            "ERR unknown command 'FUNCTION', with args beginning with: 'LOAD' 'REPLACE'",
            "ERR unknown subcommand 'LOAD'. Try FUNCTION HELP.",
        ] {
            assert!(refused(&error(refusal)), "{refusal}");
        }
        for failure in [
            "ERR Error compiling function: user_function:1: unexpected symbol",
            "LOADING Redis is loading the dataset in memory",
            "Connection reset by peer",
        ] {
            assert!(!refused(&error(failure)), "{failure}");
        }
    }

    #[test]
    fn the_script_form_runs_the_same_code() {
        let script = as_script(SCRIPT, "decide_call", "");
        assert!(script.starts_with("#!lua\n"));
        assert!(!script.contains("register_function("));
        assert!(!script.contains("register_function{"));
        assert!(
            script
                .trim_end()
                .ends_with("return decide_call(_G.KEYS, _G.ARGV)")
        );
        assert_eq!(script.lines().count(), SCRIPT.lines().count() + 1);
        // The decision's script makes none of the other entries' functions.
        assert!(!script.contains("quota_call = function"));
        assert!(!script.contains("undo_call = function"));
        assert!(SCRIPT.contains("quota_call = function"));
        let inspect = as_script(SCRIPT, "inspect_call", Function::Inspect.script_flags());
        assert!(inspect.starts_with("#!lua flags=no-writes\n"));
        assert!(inspect.ends_with("return inspect_call(_G.KEYS, _G.ARGV)"));
    }

    /// Every function the library registers is one this type names, and the other way round.
    #[test]
    fn each_function_is_registered_on_a_line_of_its_own() {
        let registered: Vec<&str> = SCRIPT
            .lines()
            .filter(|line| line.starts_with("redis.register_function"))
            .collect();
        assert_eq!(registered.len(), 2 + Function::ALL.len(), "{registered:#?}");
        for function in Function::ALL {
            let (suffix, entry) = function.suffix_and_entry();
            let line = registered
                .iter()
                .find(|line| line.contains(&format!("'{NAME_IN_SOURCE}{suffix}'")))
                .unwrap_or_else(|| panic!("{function:?} is not registered"));
            assert!(line.contains(entry), "{line}");
            let flag = function
                .script_flags()
                .strip_prefix(" flags=")
                .unwrap_or_default();
            assert_eq!(line.contains("flags"), !flag.is_empty(), "{line}");
            assert!(line.contains(flag), "{line}");
        }
    }

    /// The header says how many locals the library's main chunk declares (Lua 5.1 allows 200
    /// active in one function): every top-level `local` line of the joined text counted.
    #[test]
    fn the_header_counts_the_main_chunk_locals() {
        let declared: usize = SCRIPT
            .lines()
            .filter_map(|line| line.strip_prefix("local "))
            .map(|names| names.split(',').filter(|n| !n.trim().is_empty()).count())
            .sum();
        let header = SCRIPT.replace("\n-- ", " ");
        assert!(
            header.contains(&format!(
                "the main chunk holds the {declared} declared here"
            )),
            "the header of lua/contract.lua should say the main chunk holds the {declared} declared here"
        );
        assert!(
            declared < 120,
            "{declared} locals: keep the main chunk well under 200"
        );
    }
}
