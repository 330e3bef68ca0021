"""The interop matrix: heterogeneous ectransport (and vLLM) nodes as separate processes on
separate host addresses, each combination with an expected outcome. ``python -m interop`` runs the
reduced matrix, ``python -m interop --full`` the full one; see ``docs/interop.md``."""
