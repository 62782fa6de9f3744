"""Starting processes: how does a job's process start, and who reaps it? The one process
launcher: a job's processes on this machine, started from one preloaded
interpreter (`zygote`), watched, stopped and reaped (`launcher`); and what every process of a
job does first (`launcher.join_group`), whoever started it.
"""
