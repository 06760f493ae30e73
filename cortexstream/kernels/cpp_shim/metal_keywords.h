// Metal address-space qualifiers as C++ (see metal_shim.h). Included right before the kernel, after every
// standard header, because `device`, `constant` and `threadgroup` are ordinary identifiers in C++.
#pragma once
#define device
#define constant
#define threadgroup static
