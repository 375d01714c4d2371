"""sm_90a CuTe DSL building blocks (see ``lowprec.cute``)."""
