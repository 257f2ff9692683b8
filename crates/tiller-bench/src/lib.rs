//! Tiller's load generators (`src/bin/`). Nothing here is part of the daemon.
