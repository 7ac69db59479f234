"""The lab's own launcher on one machine: a process host that forks preloaded ranks."""
