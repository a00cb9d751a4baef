"""The bundle on one machine: plan every process from the config (`render`, with the host
facts from `inputs`), run and supervise them (`supervisor`, `processes`), record how they
fare (`runstate`), and do all that detached (`daemon`).
"""
