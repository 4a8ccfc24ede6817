"""Recipes: a whole experiment (prepare, train, average, score) as a sequence of ``megaformer`` commands.

Each recipe runs the commands a user would type, each logged before it runs, so any step can be
repeated by hand; its choices live here, tested, and its ``make`` target only passes arguments.
"""
