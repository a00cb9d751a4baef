"""What every part of the server shares and nothing else defines: the literal types of
roles, devices and block hashes (`types`) and the loopback port picker (`ports`).

Imports nothing of ours, so the router, which runs alone, may use it too.
"""
