"""Studies behind the method's settled choices (docs/decisions/): one-off experiments, not product features. They
import the product (kvpop, pipelines, benchmarks), never the other way round; their tests run only with
``pytest --run-research``."""
