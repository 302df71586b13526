# For C users of the installed libsublet: sublet.pc (pkg-config) and a CMake package config
# (find_package(sublet) gives the imported target sublet::sublet). Both come from the same
# install paths and PROJECT_VERSION, and are checked by tests/check-install.
include(CMakePackageConfigHelpers)

configure_file(${CMAKE_CURRENT_LIST_DIR}/sublet.pc.in ${CMAKE_CURRENT_BINARY_DIR}/sublet.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/sublet.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

set(SL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/sublet)
install(EXPORT sublet-targets NAMESPACE sublet:: DESTINATION ${SL_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/sublet-config.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/sublet-config.cmake INSTALL_DESTINATION ${SL_CMAKE_DIR})
# 0.x: a minor version may break the API, so only the same minor version is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/sublet-config-version.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/sublet-config.cmake
        ${CMAKE_CURRENT_BINARY_DIR}/sublet-config-version.cmake DESTINATION ${SL_CMAKE_DIR})
