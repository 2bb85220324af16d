"""Sampling: checkpoints in (``loading``), images out (``generate``), a grid (``grid``), FID sample sets
(``fid_set``), what it cost (``cost``), and diffusers pipelines out (``export``)."""
