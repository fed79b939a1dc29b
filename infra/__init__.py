"""infra/: everything that runs LoGRA but is not LoGRA, one concept a file (train.py wires them).
The method itself is the top level's sketch.py, rowadam.py, kl_control.py, sync.py and ppo.py."""
