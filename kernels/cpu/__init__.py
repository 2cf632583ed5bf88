"""The CPU kernels in C (``*.c`` with the shared vector header ``cpu_vec.h``), their loaders (one module per
library, compiled on first use by ``cpu_build``), and the choices between them and their torch twins made by
timing on this CPU (``cpu_choice``, ``cpu_twins``)."""
