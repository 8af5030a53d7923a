"""What runs on a host besides the checks: the agent, bounded processes, the status vocabulary and the seams.

Like ``preflight.checks``, this package imports only itself and the standard library (Python 3.9): the agent ships
both packages to a host as an in-memory zip, without the coordinator (see ``preflight.remote.agent_code``).
"""
