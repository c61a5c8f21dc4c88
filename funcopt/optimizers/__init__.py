"""One file per algorithm: the functional kernel, its scriptable core and the Python optimizer."""
