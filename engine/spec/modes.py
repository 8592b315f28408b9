"""Names of the speculation settings shared by the engine and the command line (torch-free, so the
CLI can list them without importing the model code)."""

MTP_MODES = ("off", "on", "adaptive", "auto")
HIDDEN_MODES = ("post-norm", "pre-norm")      # which main hidden state feeds the MTP head (spec §6.2)
ROLLBACK_MODES = ("per_step", "redecode")     # GDN rollback: per-step states (§3.5) or re-decode (§3.6)
DEFAULT_MODE = "auto"                         # CLARIFICATIONS: the default of generate, serve and the app
DEFAULT_DRAFT = 3
STEP_MODES = ("auto", "compiled", "eager")   # `--steps`: how cached decode steps run (engine/model/steps.py)
