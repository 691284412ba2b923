"""Hopper-only kernels (Gluon, sm_90a): the warp-specialized sparse MLA kernel, which
``attention/sparse_mla_decode.py`` and ``attention/sparse_mla_prefill.py`` run on an H100 where it compiles
(``_compat.GLUON_WS``). Imported only from there, and only where Gluon exists."""
