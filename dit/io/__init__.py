"""Foundations, no torch: configuration sections and faces (``config``, ``cli``), errors, atomic writes, the
small files a user names (``userfiles``), progress bars, and what a launcher's environment asks for."""
