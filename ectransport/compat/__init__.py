"""Wire-compatibility profiles: speak another implementation's EC transfer protocol.

Front-end layer (like ``ectransport.cli`` / ``ectransport.vllm``): it may use every layer below and
nothing below may import it. Each profile is **opt-in**: it is refused unless the operator names it
explicitly (see :mod:`ectransport.compat.vllm_wire`).
"""
