"""The exit status of every `trtedge` command; docs/cli.md#exit-status is this table (a test compares)."""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
INTERRUPTED = 130

MEANING = {
    OK: "done; also `serve` stopped by Ctrl-C or SIGTERM once it has drained, a chat session left with "
    "Ctrl-D or `/exit`, and a benchmark some of whose requests failed (its report counts them)",
    FAILED: "it ran and failed: a bundle could not be built or written, a server broke off the answer, "
    "a benchmark's warm-up or every one of its requests failed, a confirmation was declined",
    USAGE: "bad input, nothing was done: a flag value; a MODEL, file or directory that does not exist or is "
    "not a model; an empty stdin; a `--url` that cannot be reached; a `serve` port in use or `--host` not of "
    "this machine",
    INTERRUPTED: "Ctrl-C cut the work short: a one-shot `chat` answer, a `bench` run, a model load, "
    "`serve`'s second Ctrl-C (128 + SIGINT, as a shell reports it)",
}
