"""Ray stages: each is `run(config) -> result`, callable from jobs and tests.

Importing the package keeps the Hugging Face libraries offline (``pipelines/offline.py``), so the Python API is as
offline as the CLIs: it must come before anything imports transformers or datasets, which read the variables once.
"""
from pipelines.offline import go_offline

go_offline()
