//! `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER` and `LIMIT_RESET_HEADER`: the three names of
//! `--limit-header-names`, each replacing its own where set.

use super::Env;
use crate::cli::ServeArgs;

pub(super) fn apply(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) {
    if given("limit_header_names") {
        return;
    }
    let names = [
        "LIMIT_LIMIT_HEADER",
        "LIMIT_REMAINING_HEADER",
        "LIMIT_RESET_HEADER",
    ];
    for (slot, name) in args.limit_header_names.iter_mut().zip(names) {
        if let Some(value) = var(name) {
            *slot = value;
        }
    }
}
