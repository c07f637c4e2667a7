# The GLSL sources ship as the package data of ``vkattn.shaders`` (pyproject maps this directory),
# found at run time with importlib.resources.
