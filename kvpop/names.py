"""The names a config is checked against, in a module that imports nothing: ``pipelines.config`` (which every CLI
process imports) reads them here instead of from the modules that implement them (``kvpop.objective``,
``kvpop.parameters``, ``kvpop.online``), which import the retrofit and its transformers model machinery (~2 s of a
core). Those modules re-export them."""

METRICS = {"kvpop": ("loss", "ret_loss", "kl", "boundary_acc"),
           "dms": ("loss", "kl", "keep_loss", "keep_rate", "target_keep_rate", "retained_fraction"),
           "streaming": ("loss", "kl")}  # per train.policy: what its objective (kvpop.objective) reports every step
TRAIN_POLICIES = tuple(METRICS)  # train.policy
TRAIN_MODES = ("scorer_only", "distill")  # train.mode: what kvpop.parameters.trainable_parameters trains
FEATURE_SOURCES = ("dense", "student")  # train.online_features: whose forward kvpop.online's scorers read
