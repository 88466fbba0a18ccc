"""One module per subcommand (see trtedge/cli.py)."""

# The speculative geometry flags and the spellings the Edge-LLM reference uses for the same settings.
DRAFT_STEP_FLAGS = ("--max-spec-draft-tokens", "--draft-step", "--spec-draft-step", "--spec-proposal-tokens")
VERIFY_TOKENS_FLAGS = ("--max-spec-verify-tokens", "--verify-tree-size", "--spec-verify-tokens")
