"""Ways of splitting the work. ``catalog`` declares them (no torch); one module each applies one."""
